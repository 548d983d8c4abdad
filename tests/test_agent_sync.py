"""``stepdoctor sync`` at the edges: traces parked in ``failed/``, a dead port, a hung server, a host
that never completes a connection. Every server here is a real socket on 127.0.0.1."""

from __future__ import annotations

import contextlib
import gzip
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepdoctor import sync, transport
from stepdoctor.spool import Spool
from support import spooling
from support.fake_server import TOKEN, Failure, FakeServer, free_port
from support.spooling import spool_traces

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
real_trace = spooling.real_trace  # a small real Kineto trace (module-scoped fixture)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("STEPDOCTOR_SERVER", "STEPDOCTOR_SPOOL", "STEPDOCTOR_TOKEN", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("STEPDOCTOR_RAISE_ERRORS", "1")


@contextlib.contextmanager
def hung_server() -> Iterator[str]:
    """Listens (the kernel completes connections) but never accepts or reads: a wedged server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextlib.contextmanager
def unconnectable_server() -> Iterator[str]:
    """A full accept queue: the kernel drops new SYNs, so a connect hangs as to a firewalled host."""
    with socket.socket() as sock, socket.socket() as filler:
        sock.bind(("127.0.0.1", 0))
        sock.listen(0)
        filler.connect(sock.getsockname())  # takes the one place in the queue
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def sync_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("stepdoctor sync:")]


def test_failed_traces_are_named_kept_for_the_same_token_and_resent_once_it_is_fixed(
    tmp_path: Path, real_trace: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--spool", str(tmp_path), "--timeout", "20"]
    failed = tmp_path / "failed"
    with FakeServer() as server:
        spool = Spool(tmp_path)
        (key,) = spool_traces(spool, real_trace, 1, server.url)
        assert sync.main([*base, "--token", "wrong"]) == 1
        assert (
            f"1 refused (moved to {failed}), 0 left in {tmp_path}, 1 in {failed}" in capsys.readouterr().out
        )

        # the same token again: the trace is named with the server's reason, and not sent
        assert sync.main([*base, "--token", "wrong"]) == 1
        named, last = sync_lines(capsys.readouterr().out)
        assert named.startswith("stepdoctor sync: failed/proj/r1/")
        assert f"{server.url} refused the upload: HTTP 401" in named
        assert "(kept: same server and token" in named and "--retry-failed" in named
        assert last == f"stepdoctor sync: 0 uploaded, 0 left in {tmp_path}, 1 in {failed}"
        assert len(server.requests) == 1

        # the token fixed: sent again without being asked
        assert sync.main([*base, "--token", TOKEN]) == 0
        named, last = sync_lines(capsys.readouterr().out)
        assert "HTTP 401" in named and "(sending again: the token (and so perhaps the team) changed" in named
        assert last == (
            f"stepdoctor sync: 1 uploaded, 1 sent again from failed/, 0 left in {tmp_path}, 0 in {failed}"
        )
        assert list(server.uploads) == [key]
        assert spool.failed() == [] and not list(failed.rglob("*.*"))


def test_another_server_gets_a_refused_trace_and_retry_failed_resends_to_the_same_one(
    tmp_path: Path, real_trace: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--spool", str(tmp_path), "--token", TOKEN, "--timeout", "20"]
    with FakeServer() as first, FakeServer() as second:
        spool = Spool(tmp_path)
        keys = spool_traces(spool, real_trace, 2, first.url)
        first.fail_next(Failure("reject", status=422), Failure("reject", status=422))
        assert sync.main(base) == 1
        assert len(spool.failed()) == 2 and first.uploads == {}
        capsys.readouterr()

        # the same server and token: kept, nothing sent
        assert sync.main(base) == 1
        assert len(first.requests) == 2
        # --retry-failed: resent to the same server, which takes them now
        assert sync.main([*base, "--retry-failed"]) == 0
        assert set(first.uploads) == set(keys) and spool.failed() == []
        assert (
            sum("(sending again: --retry-failed)" in line for line in capsys.readouterr().out.splitlines())
            == 2
        )

        # refused by the first server, then pointed at another one: sent there
        (other,) = spool_traces(spool, real_trace, 1, first.url, run="r2")
        first.fail_next(Failure("reject", status=422))
        assert sync.main(base) == 1
        capsys.readouterr()
        assert sync.main([*base, "--server", second.url]) == 0
        assert f"(sending again: the server is now {second.url})" in capsys.readouterr().out
        assert list(second.uploads) == [other]


def test_a_dead_port_is_reported_before_every_wait_and_what_is_left_is_counted(
    tmp_path: Path, real_trace: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    spool_traces(Spool(tmp_path), real_trace, 2, url)
    argv = ["--spool", str(tmp_path), "--token", TOKEN, "--timeout", "3", "--backoff-base", "0.3"]
    assert sync.main(argv) == 1
    out, err = capsys.readouterr()
    waits = sync_lines(err)[1:]  # after the line saying what it sends
    assert waits, err
    assert all("server not reachable (ConnectionRefusedError" in line for line in waits)
    assert all("; 2 left, " in line and "(--timeout)" in line for line in waits), waits
    (last,) = sync_lines(out)
    assert f"0 uploaded, 2 left in {tmp_path}, 0 in {tmp_path / 'failed'}" in last
    assert "last error: ConnectionRefusedError" in last
    assert len(Spool(tmp_path).sidecars()) == 2


def test_timeout_bounds_the_whole_command_against_a_hung_server(
    tmp_path: Path, real_trace: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    """The per-request read timeout stays 60 s; --timeout 3 cuts the request in flight."""
    with hung_server() as url:
        spool_traces(Spool(tmp_path), real_trace, 1, url)
        started = time.monotonic()
        code = sync.main(["--spool", str(tmp_path), "--token", TOKEN, "--timeout", "3"])
        elapsed = time.monotonic() - started
    assert code == 1
    assert elapsed < 3 + 10, elapsed  # the old per-request 60 s is far beyond
    out, err = capsys.readouterr()
    first = sync_lines(err)[0]  # said before the first request, which the server holds
    assert first.startswith("stepdoctor sync: 1 trace (")
    assert first.endswith(f" MB) waiting in {tmp_path}; sending (giving up after 3 s, --timeout)")
    (last,) = sync_lines(out)
    assert f"0 uploaded, 1 left in {tmp_path}" in last
    assert "last error: DeadlineExceeded: no answer within the time limit" in last
    assert len(Spool(tmp_path).sidecars()) == 1


def test_every_connection_is_bounded_by_the_connect_timeout(tmp_path: Path, real_trace: bytes) -> None:
    trace = tmp_path / "t.pt.trace.json.gz"
    trace.write_bytes(gzip.compress(real_trace))
    sidecar = {"project": "proj", "run": "r1", "idempotency_key": "k" * 32}
    with unconnectable_server() as url:
        started = time.monotonic()
        result = transport.upload(url, TOKEN, trace, sidecar, 60.0, connect_timeout=1.0)
        elapsed = time.monotonic() - started
    assert result.outcome == "retry" and result.status is None and not result.connected
    assert result.detail.startswith("TimeoutError") and "(connecting)" in result.detail
    assert elapsed < 1 + 20, elapsed  # the 60 s read timeout does not apply to connecting


def test_sync_passes_its_connect_timeout_to_every_request(
    tmp_path: Path, real_trace: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    with unconnectable_server() as url:
        spool_traces(Spool(tmp_path), real_trace, 1, url)
        argv = ["--spool", str(tmp_path), "--token", TOKEN, "--connect-timeout", "0.5", "--timeout", "4"]
        assert sync.main(argv) == 1
    out, err = capsys.readouterr()
    waits = sync_lines(err)[1:]
    assert waits and all("server not reachable (TimeoutError: timed out (connecting))" in w for w in waits)
    (last,) = sync_lines(out)  # the last try may be cut by --timeout instead, while connecting
    assert f"0 uploaded, 1 left in {tmp_path}" in last
    assert last.endswith(
        ("TimeoutError: timed out (connecting)", "DeadlineExceeded: no answer within the time limit")
    )


def test_sync_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        sync.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text
    for option in ("--retry-failed", "--timeout", "--connect-timeout", "failed"):
        assert option in text


@pytest.mark.parametrize("option", ["--timeout", "--connect-timeout", "--http-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_time_limit_that_bounds_nothing_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str
) -> None:
    assert sync.main(["--spool", str(tmp_path), option, value]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"stepdoctor sync: {option} must be a finite number of seconds above 0\n"


def test_compression_stops_at_the_deadline_and_keeps_the_export(tmp_path: Path, real_trace: bytes) -> None:
    """A multi-GB raw export takes a minute to compress: --timeout bounds that too."""
    spool = Spool(tmp_path)
    spool_traces(spool, real_trace, 1, None)
    with spool.claim(spool.sidecars()[0]) as entry:
        assert entry is not None
        with pytest.raises(TimeoutError, match="did not finish in time"):
            Spool.compress(entry, 6, deadline=time.monotonic() - 1)
        assert entry.export.read_bytes() == real_trace and not entry.trace.exists()
        assert [p.name for p in tmp_path.rglob("*.partial")] == []
        Spool.compress(entry, 6)  # the next sync, with time left
        assert gzip.decompress(entry.trace.read_bytes()) == real_trace
