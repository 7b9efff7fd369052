#!/usr/bin/env python
"""Write dashboards/elastic_trainer.json and dashboards/alerts.yml from elastic_trainer/metrics.

Run after changing a metric in elastic_trainer/metrics/names.py. With --check,
write nothing and exit 1 if a file on disk differs from what would be written
(tests and CI use this to keep the generated files in step with the code).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Runs from a checkout without the package installed, too.
sys.path.insert(0, str(ROOT))

from elastic_trainer.metrics.dashboards import render  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the files on disk are not up to date")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "dashboards", help="default: %(default)s")
    args = ap.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = args.out_dir / name
        current = path.read_bytes() if path.exists() else None
        if current == text.encode():
            continue
        if args.check:
            stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode())
            print(f"wrote {path}")
    if stale:
        print("out of date (run python scripts/gen_dashboards.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
