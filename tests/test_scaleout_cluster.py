"""A team deployment on one machine, as if on several: real PostgreSQL, real S3, separate processes.

An API process (``serve --workers 0``) and two ``stepdoctor worker`` processes, each worker with
its own empty data directory (nothing shared but the database and the bucket), each in its own
process group so killing one takes its job children with it, like losing a host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select, text

from stepdoctor_server.auth import tokens as auth
from stepdoctor_server.core import migrate
from stepdoctor_server.core.database import Database
from stepdoctor_server.core.models import Analysis, Run, Trace
from stepdoctor_server.core.settings import Settings
from support.s3 import S3Server, s3_server  # noqa: F401 - fixture
from support.server import (
    FIXTURE_TRACES,
    REPO_ROOT,
    _fresh_postgres_database,
    _postgres_unreachable_reason,
    serve_subprocess,
    upload,
)

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

HTA = FIXTURE_TRACES / "hta"
BIG = HTA / "trace_diff" / "control" / "control.json.gz"
EIGHT_RANKS = [
    HTA / "trace_filter" / "sampled_rank-0.json.gz",
    HTA / "trace_filter" / "sampled_rank-1.json.gz",
    HTA / "critical_path" / "cuda_event_sync" / "event_sync_trace.json.gz",
    HTA / "critical_path" / "cuda_event_sync_multi_stream" / "event_sync_trace.json.gz",
    HTA / "negative_queue_length_values_check" / "rank0.json.gz",
    HTA / "trace_compare" / "base" / "base.json.gz",
    HTA / "trace_compare" / "test" / "test.json.gz",
    HTA / "trace_diff" / "test" / "test.json.gz",
]
# Liveness settings short enough for a test; production defaults are 30 s, 5 s and 5 s (a job
# put back for a lost worker sends no NOTIFY: the survivor finds it at its next poll).
FAST_LIVENESS = {
    "STEPDOCTOR_WORKER_STALLED_AFTER_S": "4",
    "STEPDOCTOR_WORKER_HEARTBEAT_S": "1",
    "STEPDOCTOR_JOB_POLL_INTERVAL_S": "0.5",
}


@dataclass
class Cluster:
    database_url: str
    storage_url: str
    env: dict[str, str]
    db: Database
    tmp: Path

    def token(self) -> str:
        with self.db.session() as session:
            team, _ = auth.get_or_create_team(session, "default")
            return auth.create_token(session, team, scope="admin", name="cluster test")[1]


@pytest.fixture
def cluster(s3_server: S3Server, tmp_path: Path) -> Iterator[Cluster]:  # noqa: F811
    reason = _postgres_unreachable_reason()
    if reason:
        pytest.skip(reason)
    with _fresh_postgres_database() as url:
        settings = Settings(data_dir=tmp_path / "migrate", database_url=url)
        migrate.upgrade(settings)  # the `migrate` service of docker-compose.yml
        storage_url = s3_server.fresh_url()
        env = {
            **s3_server.env,
            **FAST_LIVENESS,
            "STEPDOCTOR_DATABASE_URL": url,
            "STEPDOCTOR_STORAGE_URL": storage_url,
            "STEPDOCTOR_WORKERS": "0",
        }
        db = Database(settings)
        try:
            yield Cluster(database_url=url, storage_url=storage_url, env=env, db=db, tmp=tmp_path)
        finally:
            db.dispose()


@dataclass
class WorkerProcess:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    data_dir: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def worker_process(cluster: Cluster, name: str) -> Iterator[WorkerProcess]:
    """``stepdoctor worker -n 1`` with its own empty data directory, in its own process group."""
    data_dir = cluster.tmp / f"host-{name}"
    data_dir.mkdir()
    log = cluster.tmp / f"worker-{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "stepdoctor", "worker", "-n", "1"],
            env={**os.environ, **cluster.env, "STEPDOCTOR_DATA_DIR": str(data_dir)},
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=str(REPO_ROOT),
            start_new_session=True,
        )
    handle = WorkerProcess(name=name, process=process, log=log, data_dir=data_dir)
    try:
        yield handle
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _wait(what: str, predicate: object, timeout_s: float, *logs: WorkerProcess) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            detail = "\n".join(f"--- {w.name}:\n{w.output()[-3000:]}" for w in logs)
            raise AssertionError(f"{what}: not after {timeout_s:.0f} s\n{detail}")
        time.sleep(0.1)


def _serve_on(database_url: str, cluster: Cluster, data_dir: Path) -> subprocess.Popen[str]:
    """``stepdoctor serve --workers 0`` on ``database_url``, its output piped (for a refusal)."""
    return subprocess.Popen(
        [sys.executable, "-m", "stepdoctor", "serve", "--workers", "0", "--port", "0"],
        env={
            **os.environ,
            **cluster.env,
            "STEPDOCTOR_DATABASE_URL": database_url,
            "STEPDOCTOR_DATA_DIR": str(data_dir),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(REPO_ROOT),
    )


def _reap(process: subprocess.Popen[str]) -> None:
    """Kill ``process`` if it still runs (a failed test must not leave a server behind)."""
    if process.poll() is None:
        process.kill()
    process.communicate()


def _live_workers(db: Database) -> int:
    with db.session() as session:
        return int(session.scalar(text("SELECT count(*) FROM procrastinate_workers")) or 0)


def _statuses(db: Database) -> dict[int, tuple[str, str | None]]:
    with db.session() as session:
        return {
            tid: (status, owner)
            for tid, status, owner in session.execute(select(Trace.id, Trace.status, Trace.claimed_by))
        }


def _pid(worker_id: str | None) -> int:
    assert worker_id is not None
    return int(worker_id.rsplit(":", 2)[1])


def _worker_pid(proc: WorkerProcess) -> int:
    return proc.process.pid  # the worker runs its jobs' bookkeeping in its main process


def test_eight_rank_run_is_shared_by_two_workers_and_aggregated_once(cluster: Cluster) -> None:
    token = cluster.token()
    with ExitStack() as stack:
        workers = [stack.enter_context(worker_process(cluster, n)) for n in ("a", "b")]
        api = stack.enter_context(
            serve_subprocess({**cluster.env, "STEPDOCTOR_DATA_DIR": str(cluster.tmp / "api")})
        )
        _wait("both workers registered", lambda: _live_workers(cluster.db) == 2, 60, *workers)
        bodies: dict[int, bytes] = {}
        with httpx.Client(
            base_url=api.url, headers={"Authorization": f"Bearer {token}"}, timeout=60
        ) as client:
            for rank, path in enumerate(EIGHT_RANKS):
                body = path.read_bytes()
                resp = upload(
                    client,
                    body,
                    project="scale",
                    run="eight",
                    rank=rank,
                    metadata={"host": f"n{rank}", "world_size": 8},
                )
                assert resp.status_code == 201, resp.text
                bodies[resp.json()["id"]] = body
            _wait(
                "all eight analysed",
                lambda: all(s == "done" for s, _ in _statuses(cluster.db).values()),
                180,
                *workers,
            )
            # Every download is the uploaded bytes, streamed from the bucket by the API.
            for trace_id, body in bodies.items():
                resp = client.get(f"/api/v1/traces/{trace_id}/download")
                assert resp.status_code == 200 and resp.content == body
            run_id = client.get(f"/api/v1/traces/{next(iter(bodies))}").json()["run_id"]
            _wait(
                "run aggregated",
                lambda: client.get(f"/api/v1/runs/{run_id}").json().get("diagnosis"),
                60,
                *workers,
            )
            diagnosis = client.get(f"/api/v1/runs/{run_id}").json()["diagnosis"]
        owners = {tid: owner for tid, (_, owner) in _statuses(cluster.db).items()}
        ran = {w.name: sorted(t for t, o in owners.items() if _pid(o) == _worker_pid(w)) for w in workers}
        print("jobs per worker:", ran)  # the record of which worker ran each job
        assert sorted(ran["a"] + ran["b"]) == sorted(bodies)  # only the two workers ran jobs
        assert ran["a"] and ran["b"], ran
        with cluster.db.session() as session:
            assert session.scalar(select(func.count(Analysis.id))) == 8
            assert session.scalar(select(Run.aggregations).where(Run.id == run_id)) == 1
        assert diagnosis["traces"] == 8
        assert "stepdoctor.worker INFO trace" not in api.output()  # the API ran no analysis
        for w in workers:  # nothing was written to a worker's own disk: traces stream from S3
            assert [p for p in w.data_dir.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_worker_lost_mid_job_its_job_completes_on_the_other(cluster: Cluster, how: signal.Signals) -> None:
    """SIGKILL: the host is gone. SIGSTOP: the worker hangs, then wakes up after its job was taken
    over; its late result must not be stored (exactly one analysis either way)."""
    token = cluster.token()
    with ExitStack() as stack:
        workers = {n: stack.enter_context(worker_process(cluster, n)) for n in ("a", "b")}
        api = stack.enter_context(
            serve_subprocess({**cluster.env, "STEPDOCTOR_DATA_DIR": str(cluster.tmp / "api")})
        )
        _wait("both workers registered", lambda: _live_workers(cluster.db) == 2, 60, *workers.values())
        with httpx.Client(
            base_url=api.url, headers={"Authorization": f"Bearer {token}"}, timeout=60
        ) as client:
            trace_id = upload(client, BIG.read_bytes(), project="scale", run="killed", rank=0).json()["id"]
        _wait("job started", lambda: _statuses(cluster.db)[trace_id][0] == "running", 60, *workers.values())
        first_owner = _statuses(cluster.db)[trace_id][1]
        victim = next(w for w in workers.values() if _worker_pid(w) == _pid(first_owner))
        survivor = next(w for w in workers.values() if w is not victim)
        os.killpg(victim.process.pid, how)  # the whole process group, job children included
        killed_at = time.monotonic()
        _wait("job completed elsewhere", lambda: _statuses(cluster.db)[trace_id][0] == "done", 60, survivor)
        assert time.monotonic() - killed_at < 60
        _status, owner = _statuses(cluster.db)[trace_id]
        assert _pid(owner) == _worker_pid(survivor)
        if how == signal.SIGSTOP:  # the hung worker wakes up and finishes its (stale) job
            os.killpg(victim.process.pid, signal.SIGCONT)
            _wait("the woken worker gave up its result", lambda: "not stored" in victim.output(), 60, victim)
        with cluster.db.session() as session:
            assert session.scalar(select(func.count(Analysis.id)).where(Analysis.trace_id == trace_id)) == 1
        assert _pid(_statuses(cluster.db)[trace_id][1]) == _worker_pid(survivor)
        assert "lost its worker; queueing it again" in survivor.output()


def test_api_with_no_workers_runs_no_analysis_and_no_migration(cluster: Cluster, tmp_path: Path) -> None:
    token = cluster.token()
    with ExitStack() as stack:
        empty_url = stack.enter_context(_fresh_postgres_database())
        with serve_subprocess({**cluster.env, "STEPDOCTOR_DATA_DIR": str(tmp_path / "api")}) as api:
            with httpx.Client(
                base_url=api.url, headers={"Authorization": f"Bearer {token}"}, timeout=60
            ) as client:
                trace_id = upload(client, EIGHT_RANKS[0].read_bytes(), run="idle").json()["id"]
                # An API replica never migrates: on an empty database it refuses to start, with
                # one line (checked below; it starts up while this test waits).
                refusing = _serve_on(empty_url, cluster, tmp_path)
                stack.callback(_reap, refusing)
                time.sleep(3)  # long enough for an in-process worker to have picked it up
                assert client.get(f"/api/v1/traces/{trace_id}").json()["status"] == "pending"
            with cluster.db.session() as session:
                job = session.execute(
                    text("SELECT status FROM procrastinate_jobs WHERE lock = :lock"),
                    {"lock": f"trace:{trace_id}"},
                ).all()
            assert [row[0] for row in job] == ["todo"]  # queued by the upload's transaction, waiting
        _, stderr = refusing.communicate(timeout=60)
        assert refusing.returncode == 2, stderr  # a CLI error: one line, exit 2
        (line,) = stderr.strip().splitlines()
        assert "not at the latest schema revision: run `stepdoctor db upgrade` first" in line
        assert migrate.current_revision(Settings(data_dir=tmp_path, database_url=empty_url)) is None


def test_deep_analysis_runs_on_a_procrastinate_worker_from_s3(cluster: Cluster) -> None:
    from stepdoctor_analysis.analyzers import deep

    if not deep.available():
        pytest.skip("HolisticTraceAnalysis (stepdoctor[hta]) missing")
    token = cluster.token()
    trace = HTA / "critical_path" / "cuda_event_sync" / "event_sync_trace.json.gz"
    with ExitStack() as stack:
        worker = stack.enter_context(worker_process(cluster, "a"))
        api_env = {**cluster.env, "STEPDOCTOR_DATA_DIR": str(cluster.tmp / "api")}
        api = stack.enter_context(serve_subprocess(api_env))
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=api.url, headers=headers, timeout=60) as client:
            trace_id = upload(client, trace.read_bytes(), run="deep").json()["id"]
            resp = client.post(f"/api/v1/traces/{trace_id}/deep/critical-path")
            assert resp.status_code == 202, resp.text

            def deep_status() -> str:
                return str(client.get(f"/api/v1/traces/{trace_id}/deep").json()[0]["status"])

            _wait("deep job finished", lambda: deep_status() in ("done", "failed"), 120, worker)
            job = client.get(f"/api/v1/traces/{trace_id}/deep").json()[0]
        assert job["status"] == "done", job
        assert job["result"]["length_us"] > 0
        assert [p for p in worker.data_dir.rglob("*") if p.is_file()] == []  # the copy was temporary
