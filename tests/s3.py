"""A real S3 endpoint for the tests of storage on a bucket: moto's standalone server (``moto[server]``) on a free
loopback port, in this process, spoken to over HTTP by pyarrow's own AWS client (MinIO is not installable here).

``s3_uri``: a fresh bucket per test, as the ``TLAB_STORAGE`` URI that names it; the credentials are the standard
AWS environment variables (set for the session, so the processes a test starts inherit them).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "tlab-test", "AWS_SECRET_ACCESS_KEY": "tlab-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


def moto_server(address: str) -> Any:
    """Moto's S3 server on ``address`` and a free port, started; its request log (a werkzeug line per request, which
    pytest would print with every failure and bury its message under) kept to warnings."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address=address, port=0, verbose=False)
    server.start()
    return server


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """``host:port`` of moto's S3 server, up for the session."""
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server = moto_server("127.0.0.1")
    host, port = server.get_host_and_port()
    try:
        yield f"{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_bucket(endpoint: str, name: str) -> None:
    import pyarrow.fs as pafs

    pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1",
                      allow_bucket_creation=True).create_dir(name)


@pytest.fixture()
def s3_uri(s3_endpoint: str) -> str:
    """``s3://<fresh bucket>/lab?endpoint_override=...&scheme=http``: a TLAB_STORAGE value."""
    name = f"tlab-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, name)
    return f"s3://{name}/lab?endpoint_override={s3_endpoint}&scheme=http&region=us-east-1"
