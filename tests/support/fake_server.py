"""A small real HTTP server on 127.0.0.1 speaking the agent -> server upload protocol.

Tests script its failures (connection dropped before/after storing, 500, 429 + Retry-After, slow
answers, down for a while) and then assert exactly-once delivery from ``uploads`` (one entry per
idempotency key) and ``requests`` (every attempt, in order).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import re
import socket
import ssl
import threading
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

NAME_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
TOKEN = "test-token"


@dataclass
class Upload:
    key: str
    project: str
    run: str
    rank: int | None
    metadata: dict[str, Any]
    trace: dict[str, Any]
    size: int
    id: int


@dataclass
class Attempt:
    key: str | None
    status: int | None  # None: connection dropped (or answer still pending); -1: client gone
    mode: str
    at: float = field(default_factory=time.monotonic)


@dataclass
class Failure:
    mode: str  # drop_before | drop_after | 500 | 503 | 429 | slow | reject
    retry_after: float | None = None
    delay: float = 0.0
    status: int = 500


@dataclass
class _State:
    uploads: dict[str, Upload] = field(default_factory=dict)
    requests: list[Attempt] = field(default_factory=list)
    failures: deque[Failure] = field(default_factory=deque)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Step-series chunks the agent sent (POST /api/v1/series): kept apart from the trace requests
    # and never given a scripted failure; answered 404, like a server without the endpoint.
    series: list[bytes] = field(default_factory=list)
    series_endpoint: bool = True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class FakeServer:
    """``with FakeServer() as srv:`` serves on ``srv.url``; ``FakeServer(start=False)`` is down until ``up()``."""

    def __init__(
        self,
        *,
        token: str = TOKEN,
        port: int | None = None,
        start: bool = True,
        parse: bool = True,
        tls: ssl.SSLContext | None = None,
        series_endpoint: bool = True,
    ) -> None:
        self.token = token
        self.parse = parse  # False: store bodies unparsed (the benchmark keeps the server's CPU use low)
        self.port = port or free_port()
        self.tls = tls  # a server-side context: HTTPS on https://localhost:PORT (the certificate's name)
        self.url = f"https://localhost:{self.port}" if tls else f"http://127.0.0.1:{self.port}"
        self.state = _State()
        self.state.series_endpoint = series_endpoint  # False: an older server, 404 for the series
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        if start:
            self.up()

    # --- lifecycle ------------------------------------------------------------------------------

    def up(self) -> None:
        if self._httpd is not None:
            return
        attrs = {"server_state": self.state, "token": self.token, "parse": self.parse}
        handler = type("Handler", (_Handler,), attrs)
        ThreadingHTTPServer.allow_reuse_address = True
        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self._httpd.daemon_threads = True
        if self.tls is not None:
            self._httpd.socket = self.tls.wrap_socket(self._httpd.socket, server_side=True)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def down(self) -> None:
        """Stop listening: new connections are refused."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._httpd = None

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # --- scripting --------------------------------------------------------------------------------

    def fail_next(self, *failures: Failure) -> None:
        """Apply these failures, in order, to the next requests."""
        with self.state.lock:
            self.state.failures.extend(failures)

    @property
    def uploads(self) -> dict[str, Upload]:
        with self.state.lock:
            return dict(self.state.uploads)

    @property
    def series(self) -> list[bytes]:
        with self.state.lock:
            return list(self.state.series)

    @property
    def requests(self) -> list[Attempt]:
        with self.state.lock:
            return list(self.state.requests)


class _Handler(BaseHTTPRequestHandler):
    server_state: _State
    token: str
    parse: bool
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        state = self.server_state
        url = urllib.parse.urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        key = self.headers.get("Idempotency-Key")
        if url.path == "/api/v1/series":
            with state.lock:
                state.series.append(body)
            if not state.series_endpoint:
                return self._answer(Attempt(None, None, "ok"), 404, {"detail": "not found"})
            return self._answer(Attempt(None, None, "ok"), 201, {"stored": True})
        with state.lock:
            failure = state.failures.popleft() if state.failures else None
        attempt = Attempt(key, None, failure.mode if failure else "ok")
        with state.lock:
            state.requests.append(attempt)  # at arrival, so the order is the order of attempts
        if url.path != "/api/v1/traces":
            return self._answer(attempt, 404, {"detail": "not found"})
        if failure is not None and failure.mode == "drop_before":
            return self._drop()
        if failure is not None and failure.mode in ("500", "503", "429", "reject"):
            status = {"500": 500, "503": 503, "429": 429}.get(failure.mode, failure.status)
            headers = {"Retry-After": f"{failure.retry_after:g}"} if failure.retry_after is not None else {}
            return self._answer(attempt, status, {"detail": f"scripted {failure.mode}"}, headers)
        status, payload = self._ingest(url.query, key, body)
        if failure is not None and failure.mode == "drop_after":
            return self._drop()
        if failure is not None and failure.mode == "slow":
            time.sleep(failure.delay)
        self._answer(attempt, status, payload)

    def _ingest(self, query: str, key: str | None, body: bytes) -> tuple[int, dict[str, Any]]:
        state = self.server_state
        if self.headers.get("Authorization") != f"Bearer {self.token}":
            return 401, {"detail": "bad or missing token"}
        params = dict(urllib.parse.parse_qsl(query))
        project, run = params.get("project", ""), params.get("run", "")
        if not (NAME_RE.match(project) and NAME_RE.match(run)):
            return 422, {"detail": "invalid project or run name"}
        if self.headers.get("Content-Encoding") != "gzip" or not key:
            return 400, {"detail": "gzip body and Idempotency-Key required"}
        raw_meta = self.headers.get("X-Stepdoctor-Metadata", "{}")
        try:
            metadata = json.loads(raw_meta)
            trace = json.loads(gzip.decompress(body)) if self.parse else {"traceEvents": [None]}
        except (OSError, ValueError) as exc:
            return 400, {"detail": f"bad body: {exc}"}
        if len(raw_meta) > 8192 or not isinstance(trace, dict) or "traceEvents" not in trace:
            return 422, {"detail": "not a Chrome trace"}
        with state.lock:
            existing = state.uploads.get(key)
            if existing is not None:
                return 200, {"id": existing.id, "run_id": 1, "status": "pending"}
            rank = int(params["rank"]) if "rank" in params else None
            upload = Upload(key, project, run, rank, metadata, trace, len(body), len(state.uploads) + 1)
            state.uploads[key] = upload
        return 201, {"id": upload.id, "run_id": 1, "status": "pending"}

    def _answer(
        self,
        attempt: Attempt,
        status: int,
        payload: dict[str, Any],
        headers: dict[str, str] | None = None,
    ) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            status = -1  # the client gave up (timeout) before the answer
        attempt.status = status

    def _drop(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)


def main() -> None:
    """``python tests/support/fake_server.py PORT``: serve until killed (the benchmark runs it out of process)."""
    import sys

    server = FakeServer(port=int(sys.argv[1]), parse=False)
    print(f"fake server on {server.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.down()


if __name__ == "__main__":
    main()
