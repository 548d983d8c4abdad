"""Job limits, transient database errors, duplicate deliveries, SQLite readers and migrations.

The distributed end-to-end evidence (two worker processes, S3, SIGKILL) is in
``test_scaleout_cluster.py``; these tests run in-process and stay fast.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text
from sqlalchemy.exc import OperationalError

from stepdoctor_server.core import migrate
from stepdoctor_server.core.models import Analysis, Trace
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.jobs.claims import SqlJobQueue
from stepdoctor_server.jobs.limits import JobFailed, run_limited
from stepdoctor_server.jobs.pool import describe_error, retry_db
from support.server import (
    FIXTURE_TRACES,
    _fresh_postgres_database,
    _postgres_unreachable_reason,
    drain,
    upload,
)

BIG = FIXTURE_TRACES / "hta" / "trace_diff" / "control" / "control.json.gz"  # 34.8 MB decompressed
SMALL = FIXTURE_TRACES / "hta" / "trace_filter" / "sampled_rank-0.json.gz"


def _limited(fn: Callable[..., Any], *args: Any, timeout_s: float = 30.0, memory_bytes: int = 0) -> Any:
    return run_limited(
        fn, args, timeout_s=timeout_s, memory_bytes=memory_bytes, describe_error=describe_error
    )


def test_child_past_the_time_limit_is_killed_with_its_reason() -> None:
    start = time.monotonic()
    with pytest.raises(JobFailed, match=r"time limit of 0.5 s \(STEPDOCTOR_JOB_TIMEOUT_S\)"):
        _limited(time.sleep, 60, timeout_s=0.5)
    assert time.monotonic() - start < 30  # killed, not waited for


def test_child_past_the_memory_limit_fails_with_its_reason() -> None:
    with pytest.raises(JobFailed, match=r"memory limit of 512 MiB") as info:
        _limited(bytearray, 2 << 30, memory_bytes=512 << 20)
    assert not info.value.internal
    assert _limited(bytearray, 1 << 20, memory_bytes=512 << 20) == bytearray(1 << 20)


def test_child_killed_by_a_signal_is_an_internal_error() -> None:
    with pytest.raises(JobFailed, match="killed by SIGABRT") as info:
        _limited(os.abort)
    assert info.value.internal


def _child_data_bytes() -> int:
    """Data segment (heap + anonymous mappings) a fresh job child starts with: the limit's base."""
    status = _limited(Path("/proc/self/status").read_text)
    kib = next(line.split()[1] for line in str(status).splitlines() if line.startswith("VmData:"))
    return int(kib) * 1024


@pytest.mark.only_db("sqlite")  # in-process engine behaviour, same code on both databases
@pytest.mark.parametrize("limit", ["time", "memory"])
def test_trace_over_a_limit_fails_with_the_limit_stored(client: TestClient, app: FastAPI, limit: str) -> None:
    if limit == "time":  # the engine needs ~0.3 s for this trace
        update, reason = {"job_timeout_s": 0.02}, "analysis exceeded the time limit of 0.02 s"
    else:  # 4 MiB above what the child starts with; this trace needs ~25 MiB more
        memory = _child_data_bytes() + (4 << 20)
        update, reason = {"job_memory_limit_bytes": memory}, "analysis exceeded the memory limit of"
    app.state.settings = app.state.settings.model_copy(update=update)
    trace_id = upload(client, BIG.read_bytes(), run="limits").json()["id"]
    assert drain(app) == 1
    body = client.get(f"/api/v1/traces/{trace_id}").json()
    assert body["status"] == "failed"
    assert body["status_reason"].startswith(reason)


def test_retry_db_waits_out_an_outage_with_one_line_per_state_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = {"n": 0}

    def flaky() -> str:
        calls["n"] += 1
        if calls["n"] <= 4:
            raise OperationalError("SELECT 1", {}, Exception("connection refused"))
        return "stored"

    with caplog.at_level(logging.WARNING, logger="stepdoctor.worker"):
        assert retry_db(flaky, what="trace 7") == "stored"
    assert calls["n"] == 5
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "database unreachable" in lines[0] and "reachable again" in lines[1]


@pytest.mark.only_db("sqlite")  # in-process engine behaviour, same code on both databases
def test_database_error_while_storing_is_retried_not_a_failure(
    client: TestClient, app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace_id = upload(client, SMALL.read_bytes(), run="transient").json()["id"]
    real_complete = SqlJobQueue.complete
    failures = {"left": 2}

    def complete_after_outage(self: SqlJobQueue, *args: object, **kwargs: object) -> bool:
        if failures["left"]:
            failures["left"] -= 1
            raise OperationalError("UPDATE traces", {}, Exception("server closed the connection"))
        return real_complete(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SqlJobQueue, "complete", complete_after_outage)
    assert drain(app) == 1
    body = client.get(f"/api/v1/traces/{trace_id}").json()
    assert body["status"] == "done" and body["status_reason"] is None
    assert failures["left"] == 0


def test_a_second_delivery_never_stores_a_second_analysis(client: TestClient, app: FastAPI) -> None:
    """Worker A was presumed dead and B took the trace over; A's late result is dropped."""
    from stepdoctor_server.traces.analysis_job import analyze_limited

    trace_id = upload(client, SMALL.read_bytes(), run="dup").json()["id"]
    queue = SqlJobQueue(app.state.db)
    with app.state.db.session() as session:
        trace = session.get(Trace, trace_id)
        key, name = trace.storage_key, trace.filename
    result = analyze_limited(app.state.settings, key, name, {})
    assert queue.claim_trace(trace_id, "host-a:1:0")
    assert queue.claim_trace(trace_id, "host-b:2:0")  # the engine re-delivered it to B
    assert queue.complete(trace_id, result, "host-b:2:0")
    assert not queue.complete(trace_id, result, "host-a:1:0")  # A wakes up late
    assert not queue.fail(trace_id, "late", "host-a:1:0")
    assert not queue.claim_trace(trace_id, "host-c:3:0")  # done: a third delivery does nothing
    with app.state.db.session() as session:
        assert session.scalar(select(func.count(Analysis.id)).where(Analysis.trace_id == trace_id)) == 1
        trace = session.get(Trace, trace_id)
        assert trace is not None and trace.status == "done" and trace.claimed_by == "host-b:2:0"


@pytest.mark.only_db("sqlite")
def test_sqlite_page_read_answers_while_another_connection_writes(
    db_url: str, tmp_path: Path, admin_token: str, app: FastAPI
) -> None:
    settings = app.state.settings.model_copy(update={"sqlite_busy_timeout_s": 1.0})
    from stepdoctor_server.web.app import create_app

    reader_app = create_app(settings)
    writer = sqlite3.connect(db_url.removeprefix("sqlite:///"), isolation_level=None, timeout=5)
    try:
        writer.execute("BEGIN IMMEDIATE")  # holds the write lock until rollback
        writer.execute("UPDATE teams SET name = name")
        with TestClient(reader_app, headers={"Authorization": f"Bearer {admin_token}"}) as client:
            started = time.monotonic()
            resp = client.get("/api/v1/projects")
            ready = client.get("/readyz")
            waited = time.monotonic() - started
        assert resp.status_code == 200, resp.text
        assert ready.status_code == 200, ready.text
        assert waited < 1.0  # it did not sit out the busy timeout behind the writer
    finally:
        writer.execute("ROLLBACK")
        writer.close()
        reader_app.state.db.dispose()


@pytest.mark.postgres
def test_replicas_migrating_together_do_not_race(tmp_path: Path) -> None:
    reason = _postgres_unreachable_reason()
    if reason:
        pytest.skip(reason)
    with _fresh_postgres_database() as url:
        settings = Settings(data_dir=tmp_path, database_url=url)
        errors: list[BaseException] = []

        def run() -> None:
            try:
                migrate.upgrade(settings)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        assert migrate.is_current(settings)
        assert migrate.procrastinate_installed(settings)


@pytest.mark.only_db("sqlite")  # in-process engine behaviour, same code on both databases
def test_worker_metrics_expose_durations_failures_and_queue_depth(client: TestClient, app: FastAPI) -> None:
    from prometheus_client import generate_latest

    from stepdoctor_server.jobs.pool import WorkerMetrics

    upload(client, SMALL.read_bytes(), run="metrics")
    metrics = WorkerMetrics(app.state.settings)
    metrics.observe("analyze", "done", 0.3)
    metrics.observe("analyze", "failed", 1.0, "analysis exceeded the time limit of 5 s")
    text = generate_latest(metrics.registry).decode()
    assert 'stepdoctor_job_duration_seconds_count{outcome="done",task="analyze"} 1.0' in text
    assert 'stepdoctor_job_failures_total{cause="time_limit",task="analyze"} 1.0' in text
    assert 'stepdoctor_queue_depth{queue="analysis"} 1.0' in text


def test_worker_without_database_logs_the_outage_once(tmp_path: Path) -> None:
    """Unreachable PostgreSQL: backoff and one warning, not a traceback per poll."""
    from support.server import worker_subprocess

    nowhere = "postgresql+psycopg://postgres@127.0.0.1:1/nowhere"
    with worker_subprocess(nowhere, tmp_path, "-n", "1") as worker:
        time.sleep(6)  # several backoff rounds (0.5, 1, 2 s ...)
    out = worker.output
    assert worker.process.returncode == 0, out
    assert out.count("database unreachable") == 1, out
    assert "Traceback" not in out and "psycopg.pool" not in out, out


@pytest.mark.only_db("postgresql")  # procrastinate runs on PostgreSQL only
def test_sweep_requeues_pending_and_orphaned_traces(client: TestClient, app: FastAPI, db_url: str) -> None:
    """The outbox safety net (procrastinate): a pending trace without a job gets one; a running
    trace whose job is gone for good goes back to pending with a job."""
    from datetime import datetime, timedelta, timezone
    from types import SimpleNamespace

    from sqlalchemy import text, update

    from stepdoctor_server.jobs import procrastinate_app as jobs

    pending = upload(client, SMALL.read_bytes(), run="sweep", rank=0).json()["id"]
    orphan = upload(client, SMALL.read_bytes(), run="sweep", rank=1).json()["id"]
    long_ago = datetime.now(timezone.utc) - timedelta(minutes=5)
    with app.state.db.session() as session:
        session.execute(text("DELETE FROM procrastinate_jobs"))  # lost: e.g. written by an older version
        session.execute(update(Trace).where(Trace.id == pending).values(updated_at=long_ago))
        session.execute(
            update(Trace)
            .where(Trace.id == orphan)
            .values(status="running", claimed_by="gone:1:0", claimed_at=long_ago, attempts=1)
        )
    runtime = jobs.Runtime(settings=app.state.settings, db=app.state.db, worker_id="test:1:0")
    task = jobs._blueprint(app.state.settings).tasks["stepdoctor.sweep_pending"]
    task.func(SimpleNamespace(additional_context={"runtime": runtime}), 0)
    with app.state.db.session() as session:
        locks = session.scalars(text("SELECT lock FROM procrastinate_jobs WHERE status = 'todo'")).all()
        assert sorted(locks) == sorted([f"trace:{pending}", f"trace:{orphan}"])
        assert session.get(Trace, orphan).status == "pending"


@pytest.mark.postgres
def test_worker_process_works_through_a_backlog_of_jobs_for_deleted_traces(tmp_path: Path) -> None:
    """Each job whose trace is gone ends at once ('already analysed or gone'), and a backlog of
    them is worked through to the end: here enough that the worker's log runs well past a pipe's
    64 KiB (``worker_subprocess`` keeps it in a file; a pipe read only at the end blocked the
    worker mid-job once full, and the jobs behind it never ran)."""
    from stepdoctor_server.core.database import Database
    from stepdoctor_server.jobs.defer import defer_analyses
    from support.server import migrated_database, worker_subprocess

    gone = list(range(1_000_000, 1_000_400))  # ids no trace has
    with migrated_database("postgresql", tmp_path) as url:
        db = Database(Settings(data_dir=tmp_path, database_url=url))
        try:
            with db.session() as session:
                defer_analyses(session, gone)
            waiting = text("SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')")

            def left() -> int:
                with db.session() as session:
                    return int(session.scalar(waiting) or 0)

            with worker_subprocess(url, tmp_path / "data", "--workers", "1") as worker:
                deadline = time.monotonic() + 300
                while left() and time.monotonic() < deadline:
                    time.sleep(0.5)
                remaining = left()
        finally:
            db.dispose()
    assert remaining == 0, f"{remaining} jobs still waiting\n{worker.output[-3000:]}"
    assert len(worker.output) > 64 << 10
    for trace_id in gone:
        assert f"trace {trace_id}: already analysed or gone" in worker.output
    assert "Traceback" not in worker.output, worker.output[-3000:]
