"""A real S3 API for the tests: a moto server on 127.0.0.1, and a fault-injecting proxy in front of it.

Import the fixtures into a test module (``from s3_server import moto_endpoint, s3_bucket``);
``pytest_plugins`` is reserved for the root conftest.

Nothing here talks to AWS: credentials are dummies, the AWS config files and the instance
metadata service are turned off, and 127.0.0.1 bypasses any proxy from the environment.
"""

from __future__ import annotations

import http.client
import logging
import socket
import struct
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
    "AWS_EC2_METADATA_DISABLED": "true",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of a moto S3 server running for the whole session."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    with pytest.MonkeyPatch.context() as mp:
        for k, v in _AWS_ENV.items():
            mp.setenv(k, v)
        server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


def s3_options(endpoint: str) -> dict[str, object]:
    """``storage_options`` that point s3fs at ``endpoint`` with the dummy credentials."""
    return {
        "key": _AWS_ENV["AWS_ACCESS_KEY_ID"],
        "secret": _AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def s3_client(endpoint: str):  # -> botocore S3 client; test-side access that bypasses tessera
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=_AWS_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
    )


def make_bucket(endpoint: str) -> str:
    name = f"tessera-{uuid.uuid4().hex[:12]}"
    s3_client(endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def s3_bucket(moto_endpoint: str) -> str:
    """A bucket shared by the session's tests (each test uses its own prefix)."""
    return make_bucket(moto_endpoint)


# ---------------------------------------------------------------------------------------------
# Fault-injecting HTTP proxy


def request_kind(method: str, target: str, headers: dict[str, str]) -> str:
    """Classify an S3 request: ``put_object``, ``upload_part``, ``get_range``, ``head``..."""
    query = urlsplit(target).query
    if method == "PUT" and "partNumber=" in query:
        return "upload_part"
    if method == "PUT":
        return "put_object"
    if method == "POST" and "uploads" in query.split("&"):
        return "create_multipart"
    if method == "POST" and "uploadId=" in query:
        return "complete_multipart"
    if method == "POST" and "delete" in query:
        return "delete_objects"
    if method == "DELETE":
        return "abort_multipart" if "uploadId=" in query else "delete"
    if method == "HEAD":
        return "head"
    if method == "GET" and "list-type=2" in query:
        return "list"
    if method == "GET" and "range" in headers:
        return "get_range"
    return "get" if method == "GET" else method.lower()


@dataclass
class Fault:
    """Fail the next ``times`` requests of ``kind`` with ``action``.

    ``action``: ``"slowdown"`` (HTTP 503 SlowDown), ``"internal"`` (HTTP 500 InternalError),
    ``"nosuchupload"`` (HTTP 404 NoSuchUpload), ``"reset"`` (the TCP connection is reset
    without an answer) or ``"lose_answer"`` (the request reaches the server and takes effect,
    then the connection is reset) or ``"stall"`` (held until :attr:`gate` is set, then
    forwarded).
    """

    kind: str
    action: str
    times: int
    hits: int = 0
    gate: threading.Event = field(default_factory=threading.Event)
    """For ``"stall"``: the request is held until this is set."""


@dataclass
class FaultProxy:
    """An HTTP proxy on 127.0.0.1 that forwards to ``upstream`` and injects :class:`Fault` s."""

    upstream: str
    faults: list[Fault] = field(default_factory=list)
    seen: list[tuple[str, str]] = field(default_factory=list)
    """``(kind, path)`` of every request, in arrival order."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def inject(self, kind: str, action: str, times: int) -> Fault:
        fault = Fault(kind, action, times)
        with self._lock:
            self.faults.append(fault)
        return fault

    def _take(self, kind: str, path: str) -> Fault | None:
        with self._lock:
            self.seen.append((kind, path))
            for f in self.faults:
                if f.kind == kind and f.hits < f.times:
                    f.hits += 1
                    return f
        return None

    def start(self) -> str:
        proxy = self
        up = urlsplit(self.upstream)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _error(self, status: int, code: str, message: str) -> None:
                body = (
                    f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                    f"<Message>{message}</Message><RequestId>tessera-test</RequestId></Error>"
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _handle(self) -> None:
                headers = {k.lower(): v for k, v in self.headers.items()}
                kind = request_kind(self.command, self.path, headers)
                body = self._body()
                fault = proxy._take(kind, urlsplit(self.path).path)
                if fault is not None and fault.action == "stall":
                    fault.gate.wait(timeout=60)
                    fault = None
                if fault is not None and fault.action == "lose_answer":
                    self._forward(body)
                    return self._reset()
                if fault is not None:
                    if fault.action == "slowdown":
                        return self._error(503, "SlowDown", "Please reduce your request rate.")
                    if fault.action == "internal":
                        return self._error(500, "InternalError", "We encountered an internal error.")
                    if fault.action == "nosuchupload":
                        return self._error(404, "NoSuchUpload", "The specified upload does not exist.")
                    if fault.action == "reset":
                        return self._reset()
                    raise ValueError(f"unknown fault action {fault.action!r}")
                answer = self._forward(body)
                self._relay(*answer)

            def _reset(self) -> None:
                # RST instead of FIN: the client sees "connection reset by peer".
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()

            def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
                try:
                    skip = {"connection", "keep-alive", "transfer-encoding", "expect", "content-length"}
                    fwd = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                    if body or self.command in ("PUT", "POST"):
                        fwd["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=fwd)
                    resp = conn.getresponse()
                    return resp.status, resp.reason, resp.getheaders(), resp.read()
                finally:
                    conn.close()

            def _relay(self, status: int, reason: str, headers: list[tuple[str, str]], data: bytes) -> None:
                self.send_response(status, reason)
                drop = {"transfer-encoding", "connection"}
                if self.command != "HEAD":  # a HEAD answer keeps the object's length
                    drop.add("content-length")
                    self.send_header("Content-Length", str(len(data)))
                for k, v in headers:
                    if k.lower() not in drop:
                        self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def fault_proxy(moto_endpoint: str) -> Iterator[tuple[FaultProxy, str]]:
    """A fresh :class:`FaultProxy` in front of the moto server, and its endpoint URL."""
    proxy = FaultProxy(moto_endpoint)
    endpoint = proxy.start()
    try:
        yield proxy, endpoint
    finally:
        proxy.stop()
