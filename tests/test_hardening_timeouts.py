"""Slow clients against a real ``stepdoctor serve`` (#12): raw sockets on 127.0.0.1.

Half-sent headers, a stalled body and a body trickling at a few bytes a second are cut off by the
server; one client address cannot hold more than its share of connections. The socket timeouts
below only bound how long the test waits for the server to act; they are not the thing measured.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from stepdoctor_server.core import migrate
from stepdoctor_server.core.settings import Settings
from support.server import ServerProcess, serve_subprocess

pytestmark = pytest.mark.slow


@contextmanager
def _server(tmp_path: Path, **env: str) -> Iterator[tuple[str, int]]:
    base = {"STEPDOCTOR_DATA_DIR": str(tmp_path / "data"), "STEPDOCTOR_WORKERS": "0"}
    migrate.upgrade(Settings(data_dir=tmp_path / "data"))  # an API-only serve does not migrate
    with serve_subprocess({**base, **env}) as server:
        yield _address(server)


def _address(server: ServerProcess) -> tuple[str, int]:
    parts = urlsplit(server.url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def _closed_by_server(sock: socket.socket, within_s: float) -> bytes | None:
    """What the server sent before closing, or None if it kept the connection open."""
    sock.settimeout(within_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return data


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """One server with short header and body limits, for the tests that only send it requests (a
    ``serve`` start costs seconds of CPU)."""
    env = {
        "STEPDOCTOR_HEADER_TIMEOUT_S": "1",
        "STEPDOCTOR_BODY_READ_TIMEOUT_S": "1",
        "STEPDOCTOR_BODY_MIN_RATE_BYTES_S": "1000",
    }
    with _server(tmp_path_factory.mktemp("guarded"), **env) as address:
        yield address


def test_half_sent_headers_and_slow_bodies_are_cut_off(guarded_server: tuple[str, int]) -> None:
    address = guarded_server
    with ExitStack() as stack:
        # 50 connections that never finish their request headers.
        half = [stack.enter_context(socket.create_connection(address)) for _ in range(50)]
        for sock in half:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        for sock in half:
            assert _closed_by_server(sock, within_s=15) is not None

        # A body that stalls after a few bytes.
        stalled = stack.enter_context(socket.create_connection(address))
        stalled.sendall(
            b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://127.0.0.1\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 100\r\n\r\ntoken="
        )
        answer = _closed_by_server(stalled, within_s=15)
        assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer

        # A body at one byte every 0.3 s: under the minimum rate once the grace period is over.
        slow = stack.enter_context(socket.create_connection(address))
        slow.sendall(
            b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 1000\r\n\r\n"
        )
        slow.settimeout(0.3)
        answer = b""
        for _ in range(100):  # at most 30 s of trickling
            try:
                slow.sendall(b"a")
                answer = slow.recv(65536)
                break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        assert answer.startswith(b"HTTP/1.1 408"), answer

        # The server still serves well-behaved clients.
        ok = stack.enter_context(socket.create_connection(address))
        ok.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        reply = _closed_by_server(ok, within_s=15)
        assert reply is not None and reply.startswith(b"HTTP/1.1 200")


def test_one_client_cannot_hold_more_than_its_connections(tmp_path: Path) -> None:
    env = {"STEPDOCTOR_MAX_CONNECTIONS_PER_CLIENT": "4", "STEPDOCTOR_HEADER_TIMEOUT_S": "60"}
    with _server(tmp_path, **env) as address, ExitStack() as stack:
        held = [stack.enter_context(socket.create_connection(address)) for _ in range(4)]
        time.sleep(0.5)  # let the server register them before the extra ones arrive
        extra = [stack.enter_context(socket.create_connection(address)) for _ in range(3)]
        for sock in extra:
            assert _closed_by_server(sock, within_s=10) == b""
        for sock in held:  # the first four are still served
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            reply = _closed_by_server(sock, within_s=10)
            assert reply is not None and reply.startswith(b"HTTP/1.1 200"), reply
        # Once they are gone, the client may connect again.
        time.sleep(0.5)
        again = stack.enter_context(socket.create_connection(address))
        again.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        reply = _closed_by_server(again, within_s=10)
        assert reply is not None and reply.startswith(b"HTTP/1.1 200")


def _stop_seconds(server: ServerProcess) -> float:
    """SIGTERM, then how long until the process is gone (bounded: a hang fails, it is not waited out)."""
    started = time.monotonic()
    server.process.terminate()
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        return float("inf")
    return time.monotonic() - started


GRACE_S = 1  # the stalled upload is answered 503 half a second before it ends


@pytest.mark.parametrize("workers", ["0", "1"])
def test_serve_stops_within_its_grace_period_with_a_request_in_flight(tmp_path: Path, workers: str) -> None:
    """An upload stalled mid-body and an idle keep-alive connection do not hold ``serve`` past
    ``STEPDOCTOR_SHUTDOWN_GRACE_S`` (1 s here; the body read timeout stays 30 s, the default): in-flight
    requests are abandoned and the process exits 0. The bound below is the grace plus process
    start-up slack on a loaded machine, not a timing claim."""
    env = {
        "STEPDOCTOR_DATA_DIR": str(tmp_path / "data"),
        "STEPDOCTOR_WORKERS": workers,
        "STEPDOCTOR_SHUTDOWN_GRACE_S": str(GRACE_S),
    }
    migrate.upgrade(Settings(data_dir=tmp_path / "data"))
    with serve_subprocess(env) as server, ExitStack() as stack:
        token = next(line.strip() for line in server.output().splitlines() if line.strip().startswith("sdt_"))
        host, port = _address(server)
        stalled = stack.enter_context(socket.create_connection((host, port), timeout=10))
        stalled.sendall(
            b"POST /api/v1/traces?project=p&run=r HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\nAuthorization: Bearer " + token.encode() + b"\r\n\r\n"
            b'{"traceEvents": [' + b" " * 1000
        )
        idle = stack.enter_context(socket.create_connection((host, port), timeout=10))
        idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert idle.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(0.5)
        took = _stop_seconds(server)
        assert took < GRACE_S + 6, f"serve took {took:.1f} s to stop:\n{server.output()}"
        # uvicorn exits by re-raising the signal it handled once shut down (status -SIGTERM).
        assert server.process.returncode in (0, -signal.SIGTERM), server.output()
        assert "Traceback" not in server.output()
        # The stalled upload was answered (not cut off with a 500), and kept nothing.
        answer = _closed_by_server(stalled, within_s=5) or b""
        assert answer.startswith(b"HTTP/1.1 503") and b"shutting_down" in answer, answer[:300]
        assert not [p for p in (tmp_path / "data" / "traces").rglob("*") if p.is_file()]


def test_content_length_with_transfer_encoding_is_400_on_the_wire(guarded_server: tuple[str, int]) -> None:
    """The real HTTP stack (h11 under uvicorn), not only the ASGI app: the request is refused and the
    connection closed, so nothing after it on the connection is read as a second request."""
    with socket.create_connection(guarded_server, timeout=10) as sock:
        body = b"5\r\nhello\r\n0\r\n\r\n"
        smuggled = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        sock.sendall(
            b"POST /api/v1/traces?project=p&run=r HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body) + len(smuggled)).encode() + b"\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + body + smuggled
        )
        reply = _closed_by_server(sock, within_s=10)
    assert reply is not None, "the server kept the connection open"
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert reply.count(b"HTTP/1.1 ") == 1, reply  # the smuggled request was never answered
