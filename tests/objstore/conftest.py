"""The bucket tests' S3 endpoint (tests/s3.py: moto's server)."""

from tests.s3 import s3_endpoint, s3_uri  # noqa: F401 - fixtures
