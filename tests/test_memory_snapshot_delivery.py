"""A window's memory snapshot travels with its trace: the agent writes it into the spool (``memory_snapshot``),
the delivery worker or ``stepdoctor sync`` sends it right after the trace to a real ``stepdoctor serve``,
and the server gives back the same bytes. Without a GPU, torch's allocator is stood in for by an object with
its two calls, returning a dict shaped like ``torch.cuda.memory._snapshot()``; the rest is the real agent."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import stepdoctor
import stepdoctor.memory_snapshot as memory_snapshot
from stepdoctor.demo_train import make_loader, make_model, train
from stepdoctor.spool import FAILED_DIR, SNAPSHOT_DIR, TRACE_SUFFIX, UPLOADED_DIR
from support.memory_snapshots import snapshot_shaped
from support.server import cli_token, migrated_sqlite_env, serve_subprocess

SMALL: dict[str, Any] = {"skip_first": 1, "warmup": 1, "active": 2, "flush_timeout": 30.0, "series": False}


class FakeCudaMemory:
    """``torch.cuda.memory``'s recording calls, for a machine without CUDA."""

    def __init__(self, snapshot: Any) -> None:
        self.snapshot = snapshot
        self.recording: list[Any] = []

    def _record_memory_history(self, enabled: Any = "all", **kwargs: Any) -> None:
        self.recording.append(enabled)

    def _snapshot(self) -> Any:
        return self.snapshot


@pytest.fixture(autouse=True)
def _agent_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("STEPDOCTOR_SERVER", "STEPDOCTOR_TOKEN", "STEPDOCTOR_DISABLED", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("STEPDOCTOR_RAISE_ERRORS", "1")  # an agent bug fails the test instead of a log line


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    env = migrated_sqlite_env(tmp_path_factory.mktemp("snapshot-server"))
    with serve_subprocess(env) as served:
        yield {"url": served.url, "upload": cli_token(env, "upload"), "read": cli_token(env, "read")}


def _train(spool: Path, run: str, monkeypatch: pytest.MonkeyPatch, snapshot: Any, **options: Any) -> Any:
    fake = FakeCudaMemory(snapshot)
    monkeypatch.setattr(memory_snapshot, "_memory_module", lambda: fake)
    loader = make_loader(workers=0, batch_size=4, steps=5, sample_ms=0.0)
    with stepdoctor.profile("local", run, spool=spool, memory_snapshot=True, **SMALL, **options) as prof:
        train(prof, loader, make_model())
    assert fake.recording and fake.recording[-1] is None  # recorded during the window, stopped after
    return prof


def _snapshot_of(server: dict[str, str], run: str) -> tuple[dict[str, Any], httpx.Response]:
    with httpx.Client(base_url=server["url"], headers={"Authorization": f"Bearer {server['read']}"}) as api:
        (found,) = [
            r
            for r in api.get("/api/v1/runs", params={"project": "local"}).json()["items"]
            if r["name"] == run
        ]
        (trace,) = api.get(f"/api/v1/runs/{found['id']}/traces").json()["items"]
        detail = api.get(f"/api/v1/traces/{trace['id']}").json()
        assert detail["memory_snapshot_url"], detail
        return detail, api.get(detail["memory_snapshot_url"])


def test_the_agent_sends_the_windows_snapshot_after_its_trace_and_it_comes_back_identical(
    tmp_path: Path, server: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    prof = _train(
        tmp_path, "online", monkeypatch, snapshot_shaped(), server=server["url"], token=server["upload"]
    )
    assert (prof.stats.delivered, prof.stats.snapshots, prof.stats.rejected) == (1, 1, 0)
    run_dir = tmp_path / "local" / "online"
    assert not list((run_dir / SNAPSHOT_DIR).glob("*.pickle"))  # sent: nothing left to send
    (copy,) = (tmp_path / UPLOADED_DIR / "local" / "online" / SNAPSHOT_DIR).glob("*.pickle")
    (trace_copy,) = (tmp_path / UPLOADED_DIR / "local" / "online").glob(f"*{TRACE_SUFFIX}")
    assert trace_copy.name.startswith(copy.stem)  # the local copy follows its trace
    detail, got = _snapshot_of(server, "online")
    assert got.status_code == 200 and got.content == copy.read_bytes()  # byte for byte
    assert pickle.loads(got.content) == snapshot_shaped()  # ours: safe to load in the test
    assert got.headers["content-type"] == "application/octet-stream"
    assert got.headers["content-disposition"].startswith("attachment; filename=")
    assert got.headers["content-disposition"].endswith(f'_{detail["id"]}.memory_snapshot.pickle"')


def test_sync_sends_an_offline_windows_snapshot_with_its_trace(
    tmp_path: Path, server: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from stepdoctor import sync

    _train(tmp_path, "offline", monkeypatch, snapshot_shaped(80))
    (pending,) = (tmp_path / "local" / "offline" / SNAPSHOT_DIR).glob("*.pickle")
    sent = pending.read_bytes()
    args = [
        "--spool",
        str(tmp_path),
        "--server",
        server["url"],
        "--token",
        server["upload"],
        "--timeout",
        "120",
    ]
    assert sync.main(args) == 0
    assert not pending.exists()
    _, got = _snapshot_of(server, "offline")
    assert got.content == sent


def test_a_refused_snapshot_is_parked_with_its_reason_and_its_trace_still_delivered(
    tmp_path: Path, server: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OrderedDict pickles as a call to its class: the server refuses it, the trace still goes."""
    prof = _train(
        tmp_path,
        "refused",
        monkeypatch,
        OrderedDict(segments=[]),
        server=server["url"],
        token=server["upload"],
    )
    assert (prof.stats.delivered, prof.stats.snapshots) == (1, 0)
    assert list((tmp_path / UPLOADED_DIR / "local" / "refused").glob(f"*{TRACE_SUFFIX}"))
    (parked,) = (tmp_path / FAILED_DIR / "local" / "refused" / SNAPSHOT_DIR).glob("*.pickle")
    reason = parked.with_name(parked.name + ".reason.txt").read_text()
    assert "refused the memory snapshot" in reason and "HTTP 422" in reason and "not a dict" in reason


def test_a_snapshot_whose_window_was_never_committed_is_cleaned_up_with_the_dead_process(
    tmp_path: Path,
) -> None:
    """A process that died between writing the snapshot and the trace's sidecar leaves only the pickle."""
    from stepdoctor.spool import META_SUFFIX, Spool, host_name

    snapshots = tmp_path / "local" / "crashed" / SNAPSHOT_DIR
    snapshots.mkdir(parents=True)
    dead = f"{host_name()}_{2**22 + 12345}.1700000000000000000"  # a pid above Linux's limit: never alive
    committed = f"{host_name()}_{2**22 + 12346}.1700000000000000001"
    for stem in (dead, committed):
        (snapshots / f"{stem}.pickle").write_bytes(pickle.dumps(snapshot_shaped(1)))
    (snapshots.parent / f"{committed}{META_SUFFIX}").write_text("{}")
    assert Spool(tmp_path).cleanup_orphans() == 1
    assert [p.stem for p in snapshots.glob("*.pickle")] == [committed]  # its trace will still send it
