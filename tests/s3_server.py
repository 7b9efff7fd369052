"""The tests' S3 server: the package's (``elastic_trainer.chaos.s3_server``), which the fault
campaign takes down and brings back too."""

from elastic_trainer.chaos.s3_server import S3Server  # noqa: F401
