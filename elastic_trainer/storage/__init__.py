"""Where a run reads and writes: local paths and object-store URIs, their credentials and their secrets kept out of every record."""
