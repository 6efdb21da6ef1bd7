"""A real S3-compatible server on 127.0.0.1 for the object-storage tests: moto's standalone server
(the one s3fs's own test suite uses), one per test session, a fresh bucket per test. Credentials
reach s3fs the way a cloud's would: from the environment (fake ones; moto accepts any)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "lmforge-test",
    "AWS_SECRET_ACCESS_KEY": "lmforge-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class S3:
    endpoint: str
    bucket: str

    def url(self, prefix: str = "ws") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def overrides(self) -> list[str]:
        return [f"runtime.storage.options={{endpoint_url: {self.endpoint}}}"]

    def env(self) -> dict[str, str]:
        return {**os.environ, **FAKE_CREDENTIALS}

    def fs(self):  # noqa: ANN201 - s3fs is imported lazily
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True, use_listings_cache=False)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3:
    for name, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    bucket = f"lmforge-{uuid.uuid4().hex[:12]}"
    import s3fs

    s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True).mkdir(bucket)
    return S3(s3_endpoint, bucket)
