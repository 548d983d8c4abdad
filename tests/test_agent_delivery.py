"""Delivery from the spool to a real HTTP server on 127.0.0.1: exactly once, whatever the server does."""

from __future__ import annotations

import gzip
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stepdoctor import sync, transport
from stepdoctor.config import Delivery
from stepdoctor.spool import EXPORT_SUFFIX, META_SUFFIX, PARTIAL, TRACE_SUFFIX, UPLOADED_DIR, Spool
from stepdoctor.worker import DeliveryWorker
from support import spooling
from support.fake_server import TOKEN, Failure, FakeServer
from support.spooling import spool_traces

FAST = Delivery(flush_timeout=10.0, http_timeout=2.0, backoff_base=0.02, backoff_max=0.2, compresslevel=1)

# An agent bug raised on the delivery thread (STEPDOCTOR_RAISE_ERRORS=1) must fail the test, not just warn.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
real_trace = spooling.real_trace  # a small real Kineto trace (module-scoped fixture)


@pytest.fixture(autouse=True)
def _raise_agent_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPDOCTOR_RAISE_ERRORS", "1")


def worker_for(
    spool: Spool, server: FakeServer, token: str = TOKEN, delivery: Delivery = FAST
) -> DeliveryWorker:
    url = server.url
    return DeliveryWorker(spool, lambda meta: (url, token) if meta.get("server") == url else None, delivery)


def spool_files(spool: Spool) -> list[str]:
    """Files still waiting or failed: everything but the local copies of uploaded traces."""
    return sorted(
        str(p.relative_to(spool.root))
        for p in spool.root.rglob("*")
        if p.is_file() and p.relative_to(spool.root).parts[0] != UPLOADED_DIR
    )


def uploaded_keys(spool: Spool) -> set[str]:
    return {
        json.loads(p.read_text())["idempotency_key"]
        for p in spool.root.glob(f"{UPLOADED_DIR}/*/*/*{META_SUFFIX}")
    }


@pytest.mark.parametrize(
    "failures",
    [
        [Failure("drop_before")],
        [Failure("drop_after"), Failure("drop_after")],
        [Failure("500"), Failure("503")],
        [Failure("slow", delay=1.5)],
    ],
    ids=["drop-before-store", "drop-after-store", "5xx", "slow"],
)
def test_each_trace_arrives_exactly_once_despite_failures(
    tmp_path: Path, real_trace: bytes, failures: list[Failure]
) -> None:
    with FakeServer() as server:
        spool = Spool(tmp_path)
        keys = spool_traces(spool, real_trace, 3, server.url)
        server.fail_next(*failures)
        worker = worker_for(
            spool, server, delivery=Delivery(http_timeout=0.5, backoff_base=0.02, backoff_max=0.1)
        )
        worker.notify()
        assert worker.flush(15.0) is True
        assert set(server.uploads) == set(keys)
        assert {r.key for r in server.requests} == set(keys)  # retries reuse the key: no duplicates
        assert worker.stats.delivered == 3 and worker.stats.retries >= 1
        assert [r.mode for r in server.requests][: len(failures)] == [f.mode for f in failures]
        assert spool_files(spool) == []
        assert uploaded_keys(spool) == set(keys)  # local copies of what the server acknowledged
        assert all(u.trace["traceEvents"] for u in server.uploads.values())
        worker.close(1.0)


def test_retry_after_is_honoured(tmp_path: Path, real_trace: bytes) -> None:
    with FakeServer() as server:
        spool = Spool(tmp_path)
        (key,) = spool_traces(spool, real_trace, 1, server.url)
        server.fail_next(Failure("429", retry_after=0.6))
        worker = worker_for(spool, server)
        worker.notify()
        assert worker.flush(10.0)
        first, second = server.requests
        assert (first.status, second.status) == (429, 201)
        assert second.at - first.at >= 0.55  # backoff base is 0.02 s: only Retry-After explains the wait
        assert list(server.uploads) == [key]
        worker.close(1.0)


@pytest.mark.parametrize("token,status", [(TOKEN, 422), ("wrong", 401)])
def test_final_rejection_goes_to_failed_with_reason_and_is_reported_once(
    tmp_path: Path, real_trace: bytes, caplog: pytest.LogCaptureFixture, token: str, status: int
) -> None:
    with FakeServer() as server:
        spool = Spool(tmp_path)
        (key,) = spool_traces(spool, real_trace, 1, server.url)
        if status == 422:
            server.fail_next(Failure("reject", status=422))
        worker = worker_for(spool, server, token=token)
        with caplog.at_level(logging.WARNING, logger="stepdoctor"):
            worker.notify()
            assert worker.flush(5.0)
            worker.notify()
            worker.flush(1.0)
        assert len(server.requests) == 1 and server.requests[0].status == status
        assert server.uploads == {}
        failed = tmp_path / "failed" / "proj" / "r1"
        reasons = list(failed.glob("*.reason.txt"))
        assert len(reasons) == 1 and f"HTTP {status}" in reasons[0].read_text()
        assert len(list(failed.glob(f"*{TRACE_SUFFIX}"))) == 1
        assert json.loads(next(failed.glob(f"*{META_SUFFIX}")).read_text())["idempotency_key"] == key
        assert sum("moved to" in r.getMessage() for r in caplog.records) == 1
        assert spool.sidecars() == []
        worker.close(1.0)
        # once the cause is fixed, `stepdoctor sync --retry-failed` sends it after all
        argv = ["--spool", str(tmp_path), "--token", TOKEN, "--retry-failed", "--timeout", "5"]
        assert sync.main(argv) == 0
        assert list(server.uploads) == [key]
        assert spool_files(spool) == []


def test_server_down_keeps_everything_then_sync_uploads_exactly_once(
    tmp_path: Path, real_trace: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    server = FakeServer(start=False)
    spool = Spool(tmp_path)
    keys = spool_traces(spool, real_trace, 3, server.url)
    worker = worker_for(spool, server)
    worker.notify()
    started = time.monotonic()
    assert worker.close(0.8) is False  # bounded: gives up at the deadline
    assert time.monotonic() - started < 3.0
    assert len(spool.sidecars()) == 3 and len(list(tmp_path.rglob(f"*{TRACE_SUFFIX}"))) == 3
    assert worker.stats.retries >= 1 and worker.stats.delivered == 0
    server.up()
    try:
        assert sync.main(["--spool", str(tmp_path), "--token", TOKEN, "--timeout", "10"]) == 0
        assert set(server.uploads) == set(keys) and len(server.requests) == 3
        assert "3 uploaded" in capsys.readouterr().out
        assert sync.main(["--spool", str(tmp_path), "--token", TOKEN, "--timeout", "2"]) == 0
        assert len(server.requests) == 3  # nothing left to send twice
    finally:
        server.down()


def test_sync_sends_local_traces_only_with_an_explicit_server(tmp_path: Path, real_trace: bytes) -> None:
    with FakeServer() as server:
        keys = spool_traces(Spool(tmp_path), real_trace, 2, None)
        assert sync.main(["--spool", str(tmp_path), "--token", TOKEN, "--timeout", "2"]) == 0
        assert server.requests == []
        assert sync.main(["--spool", str(tmp_path), "--server", server.url, "--token", TOKEN]) == 0
        assert set(server.uploads) == set(keys)


def test_uncommitted_or_half_written_files_are_never_uploaded(tmp_path: Path, real_trace: bytes) -> None:
    """A process killed mid-capture leaves partials without a sidecar: ignored, then cleaned up."""
    spool = Spool(tmp_path)
    directory = spool.run_dir("proj", "r1")
    dead_pid = 2**22 + 12345  # above pid_max defaults: never alive
    dead = f"{Spool.new_stem().rsplit('_', 1)[0]}_{dead_pid}.{time.time_ns()}"
    (directory / f"{dead}{EXPORT_SUFFIX}{PARTIAL}").write_bytes(real_trace[: len(real_trace) // 2])
    (directory / f"{dead}{TRACE_SUFFIX}{PARTIAL}").write_bytes(b"\x1f\x8b half")
    # committed, but the process died before compressing: the export is complete and must go
    (key,) = spool_traces(spool, real_trace, 1, None)
    with FakeServer() as server:
        assert sync.main(["--spool", str(tmp_path), "--server", server.url, "--token", TOKEN]) == 0
        assert list(server.uploads) == [key]
        assert json.loads(json.dumps(server.uploads[key].trace)) == json.loads(real_trace)
    assert spool_files(spool) == []


def test_claim_is_exclusive(tmp_path: Path, real_trace: bytes) -> None:
    spool = Spool(tmp_path)
    spool_traces(spool, real_trace, 1, None)
    (sidecar,) = spool.sidecars()
    with spool.claim(sidecar) as first, spool.claim(sidecar) as second:
        assert first is not None and second is None
    with spool.claim(sidecar) as again:
        assert again is not None


# Another process (a second rank sharing the spool, or ``stepdoctor sync``) tries the same claim.
_CLAIM_IN_ANOTHER_PROCESS = """
import sys
from pathlib import Path
from stepdoctor.spool import Spool
with Spool(Path(sys.argv[1])).claim_series(Path(sys.argv[2])) as mine:
    print(mine)
"""


def test_a_claim_holds_while_its_holder_reads_the_file(tmp_path: Path) -> None:
    """The holder reads the chunk to send it (its header, then the upload): closing those reads
    must not free the claim for another rank, or both send it and one fails to move it."""
    spool = Spool(tmp_path)
    chunk = tmp_path / "proj" / "run" / "series-0123456789ab-0000000.stepdoctor.series"
    chunk.parent.mkdir(parents=True)
    chunk.write_bytes(b"not a real chunk: only the lock matters here")
    probe = [sys.executable, "-c", _CLAIM_IN_ANOTHER_PROCESS, str(tmp_path), str(chunk)]
    with spool.claim_series(chunk) as mine:
        assert mine
        Spool.series_meta(chunk)  # opens and closes the chunk, as the upload does
        chunk.read_bytes()
        other = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        assert other.stdout.strip() == "False", other.stdout + other.stderr
    freed = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert freed.stdout.strip() == "True", freed.stdout + freed.stderr


def test_compression_is_atomic_and_valid(tmp_path: Path, real_trace: bytes) -> None:
    spool = Spool(tmp_path)
    spool_traces(spool, real_trace, 1, None)
    with spool.claim(spool.sidecars()[0]) as entry:
        assert entry is not None
        Spool.compress(entry, 1)
        assert not entry.export.exists() and gzip.decompress(entry.trace.read_bytes()) == real_trace
    assert not any(p.name.endswith(PARTIAL) for p in tmp_path.rglob("*"))


def test_retry_after_parsing_and_classification() -> None:
    assert transport.parse_retry_after("7") == 7.0
    assert transport.parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == pytest.approx(
        10.0
    )
    assert transport.parse_retry_after("soon") is None
    assert transport.classify(201, "{}", None).outcome == "delivered"
    assert transport.classify(200, "{}", None).outcome == "delivered"
    for status in (408, 429, 500, 502, 503):
        assert transport.classify(status, "", "3").outcome == "retry"
    assert transport.classify(503, "", "3").retry_after == 3.0
    for status in (400, 401, 403, 413, 415, 422):
        assert transport.classify(status, "", None).outcome == "rejected"


def test_metadata_header_fits_the_protocol_limit() -> None:
    meta = {
        "host": "h",
        "rank": 1,
        "argv": ["x" * 500] * 100,
        "tags": {f"k{i}": "v" * 100 for i in range(200)},
    }
    text = transport.metadata_header(meta)
    assert len(text) <= transport.METADATA_HEADER_MAX
    parsed = json.loads(text)
    assert parsed["rank"] == 1 and parsed["host"] == "h"


def test_child_process_worker_is_inert(tmp_path: Path) -> None:
    """After fork, the parent's worker must neither start threads nor block in the child."""
    worker = DeliveryWorker(Spool(tmp_path), None, FAST)
    pid = os.fork()
    if pid == 0:  # child
        started = time.monotonic()
        worker.notify()
        ok = worker.flush(5.0) is False and worker._thread is None and time.monotonic() - started < 1
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_broken_sidecar_is_parked_not_retried_forever(tmp_path: Path, real_trace: bytes) -> None:
    spool = Spool(tmp_path)
    spool_traces(spool, real_trace, 1, None)
    (sidecar,) = spool.sidecars()
    sidecar.write_text('{"project": "proj"')  # truncated JSON
    with FakeServer() as server:
        assert sync.main(["--spool", str(tmp_path), "--server", server.url, "--token", TOKEN]) == 1
        assert server.requests == []
    (reason,) = (tmp_path / "failed" / "proj" / "r1").glob("*.reason.txt")
    assert "unusable sidecar" in reason.read_text()
    assert spool.sidecars() == []


def test_a_flush_tries_a_server_that_was_down_at_once_and_gives_up_at_once_if_still_down(
    tmp_path: Path, real_trace: bytes
) -> None:
    server = FakeServer(start=False)
    spool = Spool(tmp_path)
    (key,) = spool_traces(spool, real_trace, 1, server.url)
    slow_backoff = Delivery(http_timeout=2.0, backoff_base=60.0, backoff_max=60.0)  # next try in 30-60 s
    worker = worker_for(spool, server, delivery=slow_backoff)
    worker.notify()
    assert worker.flush(10.0) is False  # refused: no point waiting the 10 s
    assert worker.stats.unreachable and worker.stats.retries == 1
    server.up()
    try:
        assert worker.flush(10.0) is True  # the flush does not wait out the backoff
        assert list(server.uploads) == [key]
    finally:
        worker.close(1.0)
        server.down()


def test_a_try_cut_by_the_exit_budget_keeps_the_cause_of_the_failures_before_it(tmp_path: Path) -> None:
    """A server that accepts and never answers: the try ends at the caller's deadline (cut short,
    which says nothing about the server), and the summary keeps the earlier real cause."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        chunk = tmp_path / "c.stepdoctor.series"
        chunk.write_bytes(b"x")
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cut = transport.upload_series(url, TOKEN, chunk, "p", "r", 30.0, deadline=time.monotonic() + 0.3)
    assert cut.outcome == "retry" and cut.cut_short and "DeadlineExceeded" in cut.detail

    worker = DeliveryWorker(Spool(tmp_path), None, FAST)
    cause = transport.Result("retry", None, "SSLCertVerificationError: certificate verify failed")
    worker._retry_later(url, cause)
    worker._retry_later(url, cut)
    assert worker.stats.last_error == cause.detail and worker.stats.retries == 2
    worker._retry_later(url, transport.Result("retry", None, "ConnectionRefusedError"))
    assert worker.stats.last_error == "ConnectionRefusedError"  # a real failure still replaces it
