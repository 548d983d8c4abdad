"""Analysis jobs end to end: upload -> queue -> engine -> stored report -> run diagnosis -> compare.

Runs on SQLite and PostgreSQL (the server-core ``db_url`` fixture). Most tests drain the queue
in-process with ``worker.process_one`` (the same code a worker process runs); the tests about
restarts, crashes and bad traces use the real process pool.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from stepdoctor_server.core.models import Analysis, Trace
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.job_handlers import start_pool
from stepdoctor_server.jobs.claims import MAX_ATTEMPTS, SqlJobQueue
from stepdoctor_server.runs.diagnosis_job import requeue_outdated_now
from support import verdict_traces as vt
from support.server import FIXTURE_TRACES, drain, synthetic_trace, upload, worker_subprocess

HTA = FIXTURE_TRACES / "hta"
RANK0 = HTA / "trace_filter" / "sampled_rank-0.json.gz"
RANK1 = HTA / "trace_filter" / "sampled_rank-1.json.gz"
KEYS = ("primary", "secondary", "breakdown", "step_time_us", "rank")


def _meta(window: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "host": "node1",
        "window": {"index": window, "first_step": 10 * window, "last_step": 10 * window + 1},
        **extra,
    }


def _upload_file(
    client: TestClient, path: Path, *, run: str = "run1", rank: int | None = 0, window: int = 0
) -> int:
    resp = upload(client, path.read_bytes(), run=run, rank=rank, metadata=_meta(window))
    assert resp.status_code == 201, resp.text
    return int(resp.json()["id"])


def _statuses(app: FastAPI, ids: Iterable[int]) -> dict[int, str]:
    with app.state.db.session() as session:
        rows = session.execute(select(Trace.id, Trace.status).where(Trace.id.in_(list(ids)))).all()
    return {tid: status for tid, status in rows}


def _wait_terminal(app: FastAPI, ids: list[int], timeout: float = 90.0) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while True:
        statuses = _statuses(app, ids)
        if all(s in ("done", "failed") for s in statuses.values()):
            return statuses
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs not finished after {timeout}s: {statuses}")
        time.sleep(0.1)


def _cli_report(path: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "stepdoctor", "analyze", "--format", "json", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return dict(json.loads(out.stdout))


def test_upload_is_analysed_like_the_cli(client: TestClient, app: FastAPI) -> None:
    trace_id = _upload_file(client, RANK0)
    assert client.get(f"/api/v1/traces/{trace_id}").json()["status"] == "pending"
    assert drain(app) == 1

    body = client.get(f"/api/v1/traces/{trace_id}").json()
    assert body["status"] == "done" and body["status_reason"] is None
    stored = body["analysis"]["report"]
    expected = _cli_report(RANK0)
    for key in KEYS:
        assert stored[key] == expected[key], key
    assert [r["id"] for r in stored["recommendations"]] == [r["id"] for r in expected["recommendations"]]
    assert body["analysis"]["primary_kind"] == expected["primary"]["kind"]
    assert body["analysis"]["engine_version"] == expected["engine_version"]
    assert body["primary_share"] == pytest.approx(expected["primary"]["share"])

    report = client.get(f"/api/v1/traces/{trace_id}/report").json()
    assert report["stale"] is False and report["report"]["primary"] == expected["primary"]


def _loader_bound_agent_trace(path: Path) -> tuple[Path, dict[str, Any]]:
    """An input-bound trace (the main process loads every batch) with the run metadata our agent
    embeds (``stepdoctor`` top-level object): 2 CPUs, ``num_workers=0``. Returns it and that metadata."""
    doc = json.loads(vt.resnet_input_bound(path.with_name("plain.json"), workers=0).read_text())
    meta = {
        "host": "node1",
        "cpu_count": 2,
        "cpu_available": 2,
        "torch": "2.13.0+cpu",
        "devices": [],
        "loader": {
            "batch_size": 32,
            "num_workers": 0,
            "pin_memory": False,
            "prefetch_factor": None,
            "persistent_workers": False,
            "type": "DataLoader",
        },
    }
    doc["stepdoctor"] = meta
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path, meta


def test_loader_change_is_the_same_offline_and_on_the_server(
    client: TestClient, app: FastAPI, tmp_path: Path
) -> None:
    """The server reads the upload's metadata, the CLI only the file: both must use what the trace
    records about the machine and the loader (2 CPUs: one worker, never the default four)."""
    path, meta = _loader_bound_agent_trace(tmp_path / "loader.pt.trace.json.gz")
    resp = upload(client, path.read_bytes(), run="loader", rank=0, metadata={**meta, **_meta(0)})
    assert resp.status_code == 201, resp.text
    assert drain(app) == 1
    stored = client.get(f"/api/v1/traces/{resp.json()['id']}").json()["analysis"]["report"]
    offline = _cli_report(path)
    cards = [
        next(r for r in rep["recommendations"] if r["id"] == "input.dataloader_workers")
        for rep in (stored, offline)
    ]
    assert cards[0]["change"] == cards[1]["change"]
    assert "num_workers=1," in cards[1]["change"]
    assert cards[1]["evidence"]["cpu_count"] == 2 and cards[1]["evidence"]["num_workers"] == 0


def test_run_diagnosis_covers_all_ranks_and_windows(client: TestClient, app: FastAPI) -> None:
    ids = [
        _upload_file(client, RANK0, rank=0, window=0),
        _upload_file(client, RANK1, rank=1, window=0),
        _upload_file(client, RANK0, rank=0, window=1),
    ]
    drain(app)
    run_id = client.get(f"/api/v1/traces/{ids[0]}").json()["run_id"]
    run = client.get(f"/api/v1/runs/{run_id}").json()
    diag = run["diagnosis"]
    reports = [client.get(f"/api/v1/traces/{i}").json()["analysis"]["report"] for i in ids]

    assert diag["traces"] == 3 and diag["windows"] == 2
    assert {r["rank"]: r["traces"] for r in diag["ranks"]} == {0: 2, 1: 1}
    weights = [len(r["steps"]) for r in reports]
    for key in reports[0]["breakdown"]:
        mean = sum(r["breakdown"][key] * w for r, w in zip(reports, weights, strict=True)) / sum(weights)
        assert diag["breakdown"][key] == pytest.approx(mean), key
    # The run's primary kind owns the most time summed over every trace.
    owned: dict[str, float] = {}
    for r, w in zip(reports, weights, strict=True):
        for kind, share in r["metrics"]["shares"].items():
            if kind != "other":
                owned[kind] = owned.get(kind, 0.0) + share * r["step_time_us"] * w
    assert diag["primary"]["kind"] == max(owned, key=lambda k: owned[k])
    assert run["primary_kind"] == diag["primary"]["kind"]
    rec_ids = {rec["id"] for r in reports for rec in r["recommendations"]}
    assert {rec["id"] for rec in diag["recommendations"]} == rec_ids


def test_claims_are_exclusive_under_concurrency(client: TestClient, app: FastAPI) -> None:
    ids = {
        int(upload(client, synthetic_trace(3), run="q", rank=i, metadata=_meta()).json()["id"])
        for i in range(12)
    }
    queue = SqlJobQueue(app.state.db)
    claimed: list[int] = []
    lock = threading.Lock()

    def claimer(n: int) -> None:
        while (tid := queue.claim(f"test:{n}:0")) is not None:
            with lock:
                claimed.append(tid)

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(claimed) == sorted(ids)
    assert set(_statuses(app, ids).values()) == {"running"}
    with app.state.db.session() as session:
        attempts = session.scalars(select(Trace.attempts).where(Trace.id.in_(ids))).all()
    assert set(attempts) == {1}


def test_jobs_claimed_too_long_ago_are_requeued_then_given_up(client: TestClient, app: FastAPI) -> None:
    """A worker that hangs (or a host that vanished) holds its claim: ``requeue_stale`` takes it back."""
    old, fresh = (
        int(upload(client, synthetic_trace(3), run="s", rank=i, metadata=_meta()).json()["id"])
        for i in range(2)
    )
    queue = SqlJobQueue(app.state.db)
    assert {queue.claim("hung:1:0"), queue.claim("busy:1:0")} == {old, fresh}
    long_ago = datetime.now(timezone.utc) - timedelta(hours=2)
    with app.state.db.session() as session:
        session.execute(update(Trace).where(Trace.id == old).values(claimed_at=long_ago))
    assert queue.requeue_stale(timedelta(minutes=30)) == 1
    assert _statuses(app, [old, fresh]) == {old: "pending", fresh: "running"}
    # A job that already took MAX_ATTEMPTS workers down fails instead of going round again.
    assert queue.claim("hung:1:0") == old
    with app.state.db.session() as session:
        session.execute(
            update(Trace).where(Trace.id == old).values(claimed_at=long_ago, attempts=MAX_ATTEMPTS)
        )
    assert queue.requeue_stale(timedelta(minutes=30)) == 0
    assert _statuses(app, [old, fresh]) == {old: "failed", fresh: "running"}


def test_reanalyze_and_stale_reports(client: TestClient, app: FastAPI, read_token: str) -> None:
    trace_id = _upload_file(client, RANK1, rank=1)
    drain(app)
    resp = client.post(f"/api/v1/traces/{trace_id}/reanalyze")
    assert resp.status_code == 202 and resp.json()["ids"] == [trace_id]
    assert client.get(f"/api/v1/traces/{trace_id}").json()["status"] == "pending"
    denied = client.post(
        f"/api/v1/traces/{trace_id}/reanalyze", headers={"Authorization": f"Bearer {read_token}"}
    )
    assert denied.status_code == 403
    assert drain(app) == 1

    # A report made by an older engine is flagged when read, and redone by the workers' sweep.
    with app.state.db.session() as session:
        session.execute(
            update(Analysis).where(Analysis.trace_id == trace_id).values(engine_version="0.0.0-old")
        )
    report = client.get(f"/api/v1/traces/{trace_id}/report").json()
    assert report["stale"] is True and report["status"] == "done" and report["report"] is not None
    assert requeue_outdated_now(app.state.db) == [trace_id]
    assert drain(app) == 1
    fresh = client.get(f"/api/v1/traces/{trace_id}/report").json()
    assert fresh["stale"] is False and fresh["status"] == "done"

    # Same for a whole run: flagged when read, redone by the sweep.
    run_id = client.get(f"/api/v1/traces/{trace_id}").json()["run_id"]
    with app.state.db.session() as session:
        session.execute(update(Analysis).where(Analysis.trace_id == trace_id).values(schema_version=0))
    run_diag = client.get(f"/api/v1/runs/{run_id}/diagnosis").json()
    assert run_diag["stale"] is True and "requeued" not in run_diag
    assert run_diag["trace_status"] == {"done": 1} and run_diag["diagnosis"]["traces"] == 1
    assert requeue_outdated_now(app.state.db) == [trace_id]
    assert drain(app) == 1
    run_diag = client.get(f"/api/v1/runs/{run_id}/diagnosis").json()
    assert run_diag["stale"] is False and run_diag["trace_status"] == {"done": 1}
    assert client.post("/api/v1/traces/999999/reanalyze").status_code == 404


def test_compare_runs(client: TestClient, app: FastAPI) -> None:
    base_id = _upload_file(client, HTA / "trace_compare" / "base" / "base.json.gz", run="base")
    other_id = _upload_file(client, HTA / "trace_compare" / "test" / "test.json.gz", run="test")
    base_run = client.get(f"/api/v1/traces/{base_id}").json()["run_id"]
    other_run = client.get(f"/api/v1/traces/{other_id}").json()["run_id"]
    assert client.get("/api/v1/compare", params={"base": base_run, "other": other_run}).status_code == 409
    drain(app)

    body = client.get("/api/v1/compare", params={"base": base_run, "other": other_run}).json()
    base_diag = client.get(f"/api/v1/runs/{base_run}").json()["diagnosis"]
    other_diag = client.get(f"/api/v1/runs/{other_run}").json()["diagnosis"]
    cmp = body["comparison"]
    assert cmp["speedup"] == pytest.approx(base_diag["step_time_us"] / other_diag["step_time_us"])
    for key, base_us in base_diag["breakdown"].items():
        other_us = other_diag["breakdown"][key]
        assert cmp["categories"][key]["delta_us"] == pytest.approx(other_us - base_us), key
        if base_us:
            assert cmp["categories"][key]["delta_pct"] == pytest.approx(
                (other_us - base_us) / base_us * 100
            ), key
    assert cmp["primary"]["base"] == base_diag["primary"]["kind"]
    assert cmp["primary"]["other"] == other_diag["primary"]["kind"]
    base_findings = {f["id"] for f in base_diag["findings"]}
    other_findings = {f["id"] for f in other_diag["findings"]}
    assert set(cmp["findings"]["persisting"]) == base_findings & other_findings
    assert set(cmp["findings"]["resolved"]) == base_findings - other_findings
    assert client.get("/api/v1/compare", params={"base": base_run, "other": 999999}).status_code == 404


# -- the process pool ----------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _pool_settings(server_settings: Settings) -> Settings:
    return server_settings.model_copy(update={"workers": 1})


def test_restart_resumes_pending_and_interrupted_jobs(
    client: TestClient, app: FastAPI, server_settings: Settings
) -> None:
    pending = _upload_file(client, RANK0, rank=0)
    interrupted = _upload_file(client, RANK1, rank=1)
    # As a worker killed mid-job leaves it: running, claimed by a process that no longer exists.
    with app.state.db.session() as session:
        session.execute(
            update(Trace)
            .where(Trace.id == interrupted)
            .values(status="running", attempts=1, claimed_by=f"{socket.gethostname()}:{_dead_pid()}:0")
        )
    pool = start_pool(_pool_settings(server_settings))
    try:
        assert _wait_terminal(app, [pending, interrupted]) == {pending: "done", interrupted: "done"}
    finally:
        pool.stop()
    with app.state.db.session() as session:
        attempts = dict(
            session.execute(
                select(Trace.id, Trace.attempts).where(Trace.id.in_([pending, interrupted]))
            ).all()
        )
    assert attempts == {pending: 1, interrupted: 2}


def test_bad_trace_fails_its_job_only(client: TestClient, app: FastAPI, server_settings: Settings) -> None:
    # A trace the parser reads (so the upload accepts it) with nothing to analyse: one memory sample.
    bad_body = json.dumps(
        {"traceEvents": [{"ph": "i", "name": "[memory]", "ts": 1, "args": {"Bytes": 64}}]}
    ).encode()
    bad = upload(client, bad_body, run="r", rank=0, gzipped=False, metadata=_meta()).json()["id"]
    good = _upload_file(client, RANK0, run="r", rank=1)
    pool = start_pool(_pool_settings(server_settings))
    try:
        assert _wait_terminal(app, [bad, good]) == {bad: "failed", good: "done"}
        assert all(p.is_alive() for p in pool._procs) and pool.restarts == 0
        run_id = client.get(f"/api/v1/traces/{bad}").json()["run_id"]
        deadline = time.monotonic() + 60  # procrastinate aggregates in a job of its own, after both
        while (client.get(f"/api/v1/runs/{run_id}").json()["diagnosis"] or {}).get("failed") != 1:
            assert time.monotonic() < deadline, "the run was never aggregated"
            time.sleep(0.2)
    finally:
        pool.stop()
    body = client.get(f"/api/v1/traces/{bad}").json()
    assert body["status_reason"] and "\n" not in body["status_reason"]
    assert not body["status_reason"].startswith("internal error"), body["status_reason"]
    assert client.get("/readyz").status_code == 200
    diag = client.get(f"/api/v1/runs/{body['run_id']}").json()["diagnosis"]
    assert diag["traces"] == 1 and diag["failed"] == 1


@pytest.mark.slow
def test_killed_worker_is_replaced_and_its_job_completes(
    client: TestClient, app: FastAPI, server_settings: Settings
) -> None:
    big = HTA / "trace_diff" / "control" / "control.json.gz"
    trace_id = _upload_file(client, big, rank=3)
    # PostgreSQL (procrastinate): the killed worker's job is put back once its heartbeat is this
    # old, and found by the next poll (retries send no NOTIFY); the defaults, 30 s and 5 s, made
    # the test wait up to 35 s. The embedded pool (SQLite) uses none of these.
    fast = {"worker_stalled_after_s": 4.0, "worker_heartbeat_s": 1.0, "job_poll_interval_s": 0.5}
    pool = start_pool(_pool_settings(server_settings).model_copy(update=fast))
    try:
        deadline = time.monotonic() + 60
        while _statuses(app, [trace_id])[trace_id] != "running":
            assert time.monotonic() < deadline, "job never started"
            time.sleep(0.02)
        victim = pool.pids[0]
        os.kill(victim, signal.SIGKILL)
        assert _wait_terminal(app, [trace_id], timeout=120) == {trace_id: "done"}
        assert pool.restarts >= 1 and victim not in pool.pids
    finally:
        pool.stop()
    assert client.get(f"/api/v1/traces/{trace_id}").json()["attempts"] == 2


def test_worker_command_analyses_and_stops_on_sigint(
    client: TestClient, app: FastAPI, server_settings: Settings
) -> None:
    trace_id = _upload_file(client, RANK1, rank=1)
    url = server_settings.database_url.get_secret_value()
    with worker_subprocess(url, server_settings.data_dir, "--workers", "1") as worker:
        assert _wait_terminal(app, [trace_id]) == {trace_id: "done"}
    assert worker.process.returncode == 0, worker.output
    assert "1 analysis process" in worker.output


def test_missing_file_fails_the_job_and_the_queue_moves_on(client: TestClient, app: FastAPI) -> None:
    lost = _upload_file(client, RANK0, run="lost", rank=0)
    kept = _upload_file(client, RANK1, run="lost", rank=1)
    with app.state.db.session() as session:
        key = session.scalar(select(Trace.storage_key).where(Trace.id == lost))
    app.state.store.path(key).unlink()
    assert drain(app) == 2
    assert _statuses(app, [lost, kept]) == {lost: "failed", kept: "done"}
    reason = client.get(f"/api/v1/traces/{lost}").json()["status_reason"]
    assert reason and key.rsplit("/", 1)[-1] not in reason  # no internal storage key in user text
