"""The spool's size cap: local copies of uploaded traces make room, oldest first; unsent traces never do."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import stepdoctor
from stepdoctor import config
from stepdoctor.config import Delivery
from stepdoctor.spool import META_SUFFIX, TRACE_SUFFIX, UPLOADED_DIR, Spool
from stepdoctor.worker import DeliveryWorker
from support import spooling
from support.fake_server import TOKEN, FakeServer
from support.spooling import spool_traces

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
real_trace = spooling.real_trace  # a small real Kineto trace (module-scoped fixture)


@pytest.fixture(autouse=True)
def _raise_agent_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPDOCTOR_RAISE_ERRORS", "1")


def deliver(spool: Spool, url: str, cap: int, timeout: float = 10.0) -> DeliveryWorker:
    delivery = Delivery(http_timeout=1.0, backoff_base=0.02, backoff_max=0.1, spool_max_bytes=cap)
    worker = DeliveryWorker(spool, lambda meta: (url, TOKEN) if meta.get("server") == url else None, delivery)
    worker.notify()
    worker.close(timeout)
    return worker


def copy_keys(spool: Spool) -> list[str]:
    """Keys of the uploaded copies, oldest capture first."""
    return [
        json.loads(p.with_name(p.name[: -len(TRACE_SUFFIX)] + META_SUFFIX).read_text())["idempotency_key"]
        for p in spool.uploaded_copies()
    ]


def gz_size(spool: Spool, url: str, trace: bytes) -> int:
    """Size of one compressed trace, measured by delivering one to a scratch spool."""
    scratch = Spool(spool.root.parent / "scratch")
    spool_traces(scratch, trace, 1, url)
    deliver(scratch, url, cap=1 << 40)
    (copy,) = scratch.uploaded_copies()
    return copy.stat().st_size


def test_uploaded_copies_are_kept_and_the_oldest_go_first(tmp_path: Path, real_trace: bytes) -> None:
    with FakeServer() as server:
        spool = Spool(tmp_path / "spool")
        size = gz_size(spool, server.url, real_trace)
        keys = []
        for _ in range(4):  # one at a time: capture order is upload order
            keys += spool_traces(spool, real_trace, 1, server.url)
            time.sleep(0.002)
        worker = deliver(spool, server.url, cap=int(2.5 * size))
        assert set(keys) <= set(server.uploads)
    assert spool.sidecars() == []
    assert copy_keys(spool) == keys[2:]  # the two newest fit; the two oldest went
    assert worker.stats.pruned == 2
    unsent, copies = spool.usage()
    assert unsent == 0 and copies <= 2.5 * size


def test_cap_zero_keeps_no_copies(tmp_path: Path, real_trace: bytes) -> None:
    with FakeServer() as server:
        spool = Spool(tmp_path)
        keys = spool_traces(spool, real_trace, 2, server.url)
        deliver(spool, server.url, cap=0)
        assert set(server.uploads) == set(keys)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_unsent_traces_are_never_deleted_and_the_overflow_is_said_once(
    tmp_path: Path, real_trace: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    """Uploaded copies go to make room for unsent traces; unsent ones stay even far over the cap."""
    server = FakeServer(start=False)
    spool = Spool(tmp_path)
    server.up()
    old = spool_traces(spool, real_trace, 2, server.url, run="old")
    deliver(spool, server.url, cap=1 << 30)
    server.down()
    assert copy_keys(spool) == old
    pending = spool_traces(spool, real_trace, 3, server.url, run="new") + spool_traces(
        spool, real_trace, 1, None, run="local"
    )
    for _ in range(3):  # every pass checks the cap; the warning comes once
        deliver(spool, server.url, cap=1000, timeout=0.3)
    assert copy_keys(spool) == []  # all copies deleted to make room...
    left = {json.loads(p.read_text())["idempotency_key"] for p in spool.sidecars()}
    assert left == set(pending)  # ...but not one unsent trace
    for sidecar in spool.sidecars():
        stem = sidecar.name[: -len(META_SUFFIX)]
        assert any(sidecar.with_name(stem + s).exists() for s in (TRACE_SUFFIX, ".export"))
    err = [line for line in capsys.readouterr().err.splitlines() if "STEPDOCTOR_SPOOL_MAX_BYTES" in line]
    assert len(err) == 1 and "none are deleted" in err[0] and str(tmp_path) in err[0]


def test_failed_traces_count_as_unsent(tmp_path: Path, real_trace: bytes) -> None:
    spool = Spool(tmp_path)
    spool_traces(spool, real_trace, 1, None)
    (sidecar,) = spool.sidecars()
    with spool.claim(sidecar) as entry:
        assert entry is not None
        spool.move_failed(entry, "HTTP 422")
    assert spool.enforce_cap(0) == (0, spool.usage()[0])
    assert len(list((tmp_path / "failed").rglob(f"*{META_SUFFIX}"))) == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1073741824", 1 << 30), ("500MB", 500_000_000), ("2GiB", 2 << 30), ("1e9", 10**9), ("0", 0)],
)
def test_the_cap_reads_sizes_as_written(monkeypatch: pytest.MonkeyPatch, text: str, expected: int) -> None:
    monkeypatch.setenv("STEPDOCTOR_SPOOL_MAX_BYTES", text)
    assert config.default_spool_max_bytes() == expected


def test_profile_takes_the_cap_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPDOCTOR_SPOOL_MAX_BYTES", "3MiB")
    prof = stepdoctor.profile("p", "r", spool=tmp_path)
    assert isinstance(prof, stepdoctor.Profile)
    assert prof.config.delivery.spool_max_bytes == 3 << 20
    assert (tmp_path / UPLOADED_DIR).exists() is False
