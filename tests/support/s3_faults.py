"""moto's S3 server in this process (``ThreadedMotoServer`` on a free port) with
faults a test switches on: requests that fail (HTTP 500, after pyarrow's retries an
``OSError``) or are slow, matched by method and a piece of the object key.

The faults sit in a WSGI layer in front of moto's own application, so the client
(pyarrow's S3 filesystem) meets them exactly as it would meet a failing or slow
S3: over HTTP, with its own retries and timeouts."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from support.s3 import CREDENTIALS, aws_credentials

_CODES = {500: "InternalError", 403: "AccessDenied"}


@dataclass
class Fault:
    """Requests whose method is ``method`` (any if empty) and whose path contains
    ``key`` fail with HTTP ``status`` (``fail``; 500 is retried by the client, 403
    is not) or first sleep ``delay`` seconds; ``times`` is how many more requests it
    hits (None: every one). ``hits`` counts them."""

    key: str
    method: str = ""
    fail: bool = True
    status: int = 403
    delay: float = 0.0
    times: int | None = None
    hits: int = 0
    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event | None = None  # a slow request waits for it (if given)

    def matches(self, method: str, path: str) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        return (not self.method or method == self.method) and self.key in path


class FaultyS3:
    """The WSGI application: moto's, behind the faults in ``faults``."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str, str]] = []  # (method, path, Range) as they came
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        hit = None
        with self._lock:
            self.requests.append((method, path, environ.get("HTTP_RANGE", "")))
            for f in self.faults:
                if f.matches(method, path):
                    f.hits += 1
                    hit = f
                    break
        if hit is not None:
            hit.started.set()
            if hit.release is not None:
                hit.release.wait(30)
            if hit.delay:
                time.sleep(hit.delay)
            if hit.fail:
                # Drain the request body, as a server that read it and then failed.
                stream = environ.get("wsgi.input")
                length = int(environ.get("CONTENT_LENGTH") or 0)
                if stream is not None and length:
                    stream.read(length)
                code = _CODES[hit.status]
                body = (
                    '<?xml version="1.0" encoding="UTF-8"?>'
                    f"<Error><Code>{code}</Code><Message>injected fault</Message></Error>"
                )
                start_response(f"{hit.status} {code}", [("Content-Type", "application/xml")])
                return [body.encode()]
        return self.app(environ, start_response)


class FaultyMotoServer:
    """``moto.server.ThreadedMotoServer`` on a free loopback port whose application is
    wrapped in :class:`FaultyS3`; one bucket, ``uri(prefix)`` a location in it."""

    def __init__(self, bucket: str = "spillover-faults") -> None:
        from moto.server import ThreadedMotoServer

        self.bucket = bucket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.faulty: FaultyS3 | None = None
        outer = self

        def entry() -> None:
            from moto.moto_server.werkzeug_app import (
                DomainDispatcherApplication,
                MotoRequestHandler,
                create_backend_app,
            )
            from werkzeug.serving import make_server

            srv = self.server
            outer.faulty = FaultyS3(DomainDispatcherApplication(create_backend_app))
            srv._server = make_server(
                "127.0.0.1", self.port, outer.faulty, True, request_handler=MotoRequestHandler
            )
            srv._server_ready_event.set()
            srv._server.serve_forever()

        self.server._server_entry = entry  # type: ignore[method-assign]

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def faults(self) -> list[Fault]:
        assert self.faulty is not None
        return self.faulty.faults

    def start(self) -> None:
        self.server.start()
        self.client().create_bucket(Bucket=self.bucket)

    def stop(self) -> None:
        self.server.stop()

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=f"http://{self.endpoint}",
            region_name="us-east-1",
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )

    def uri(self, prefix: str) -> str:
        return (
            f"s3://{self.bucket}/{prefix}"
            f"?endpoint_override={self.endpoint}&scheme=http&region=us-east-1"
        )

    def fresh_uri(self) -> str:
        return self.uri(f"run-{uuid.uuid4().hex[:12]}")

    def keys(self, prefix: str = "") -> list[str]:
        """Every object's key under ``prefix`` (the bucket's own listing), without the
        empty directory markers pyarrow makes."""
        out: list[str] = []
        pages = self.client().get_paginator("list_objects_v2")
        for page in pages.paginate(Bucket=self.bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", []) if not o["Key"].endswith("/")]
        return sorted(out)


@pytest.fixture(scope="module")
def faulty_s3() -> Iterator[FaultyMotoServer]:
    """One faulty moto server per test module (its faults cleared after each test by
    :func:`s3_faults`), with the ``AWS_*`` credentials set."""
    with aws_credentials():
        server = FaultyMotoServer()
        try:
            server.start()
            yield server
        finally:
            server.stop()


@pytest.fixture
def s3_faults(faulty_s3: FaultyMotoServer) -> Iterator[FaultyMotoServer]:
    """The module's faulty server, without faults when the test begins and ends."""
    faulty_s3.faults.clear()
    try:
        yield faulty_s3
    finally:
        for f in faulty_s3.faults:
            if f.release is not None:
                f.release.set()
        faulty_s3.faults.clear()
