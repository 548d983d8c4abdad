"""Team deployment figures: worker scaling, enqueue -> start latency, upload -> stored, local vs S3.

Everything real and on loopback: PostgreSQL on 127.0.0.1:5432 (a fresh database, dropped after),
SeaweedFS ``weed mini`` for S3, ``stepdoctor worker`` processes each with its own empty data
directory, and ``stepdoctor serve --workers 0`` as the API.

1. Throughput: the GPU fixture batch (``--copies`` times) re-queued in one commit, analysed by 1
   then 2 worker processes (``worker -n 1`` each); wall time from the commit to the last stored
   analysis, side by side with the ratio. On a machine with fewer free cores than workers the
   ratio shows the contention, not the design.
2. Enqueue -> start: single jobs queued one at a time on idle workers; procrastinate wakes by
   LISTEN/NOTIFY (from its own ``deferred``/``started`` events) vs the embedded pool's polling
   (SQLite, ``traces.updated_at`` -> ``claimed_at``).
3. Upload -> analysis stored for the 34.8 MB ``trace_diff/control`` trace through the HTTP API,
   traces in a local directory shared by API and worker vs in S3.

    .venv/bin/python bench/scaleout.py [--copies 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests")]

import httpx  # noqa: E402
from sqlalchemy import select, text  # noqa: E402

from stepdoctor_server.auth import tokens as auth  # noqa: E402
from stepdoctor_server.core import migrate  # noqa: E402
from stepdoctor_server.core.database import Database  # noqa: E402
from stepdoctor_server.core.models import Analysis, Trace  # noqa: E402
from stepdoctor_server.core.settings import Settings  # noqa: E402
from stepdoctor_server.jobs.claims import reset_to_pending  # noqa: E402
from support.fixtures import GPU_FIXTURES, HTA_TRACES  # noqa: E402
from support.s3 import S3Server, running_weed  # noqa: E402
from support.server import _fresh_postgres_database, serve_subprocess, upload  # noqa: E402

BIG = HTA_TRACES / "trace_diff" / "control" / "control.json.gz"


@contextmanager
def workers(
    count: int, env: dict[str, str], tmp: Path, *, own_data_dir: bool = True
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` x ``stepdoctor worker -n 1``, each with its own empty data dir unless told not to."""
    procs = []
    try:
        for i in range(count):
            data = (
                Path(tempfile.mkdtemp(dir=tmp, prefix="host-"))
                if own_data_dir
                else Path(env["STEPDOCTOR_DATA_DIR"])
            )
            log = (tmp / f"worker-{i}-{time.monotonic_ns()}.log").open("wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "stepdoctor", "worker", "-n", "1"],
                    env={**os.environ, **env, "STEPDOCTOR_DATA_DIR": str(data)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    start_new_session=True,
                )
            )
        yield procs
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 600, poll_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark step did not finish")
        time.sleep(poll_s)


def live_workers(db: Database) -> int:
    query = text("SELECT count(*) FROM procrastinate_workers WHERE last_heartbeat > now() - interval '5 s'")
    with db.session() as s:
        return int(s.scalar(query) or 0)


def all_done(db: Database, ids: list[int]) -> bool:
    with db.session() as s:
        statuses = s.scalars(select(Trace.status).where(Trace.id.in_(ids))).all()
    return all(st in ("done", "failed") for st in statuses)


def throughput(db: Database, env: dict[str, str], tmp: Path, ids: list[int], count: int) -> float:
    with workers(count, env, tmp):
        wait_for(lambda: live_workers(db) >= count, 120, 0.1)
        time.sleep(1.0)  # let the forkservers warm up
        with db.session() as s:
            reset_to_pending(s, ids)
        start = time.perf_counter()
        wait_for(lambda: all_done(db, ids))
        return time.perf_counter() - start


def procrastinate_latency(db: Database, env: dict[str, str], tmp: Path, trace_id: int, n: int) -> list[float]:
    """From procrastinate's own events: ``deferred`` -> ``started`` of each job."""
    out = []
    events = text(
        "SELECT max(at) FILTER (WHERE type = 'deferred'), max(at) FILTER (WHERE type = 'started') "
        "FROM procrastinate_events WHERE job_id = :j"
    )
    with workers(1, env, tmp):
        wait_for(lambda: live_workers(db) >= 1, 120, 0.1)
        time.sleep(1.0)
        for _ in range(n):
            with db.session() as s:
                reset_to_pending(s, [trace_id])
                job = s.scalar(
                    text("SELECT max(id) FROM procrastinate_jobs WHERE lock = :l"), {"l": f"trace:{trace_id}"}
                )
            wait_for(lambda: all_done(db, [trace_id]))
            with db.session() as s:
                deferred, started = s.execute(events, {"j": job}).one()
            out.append((started - deferred).total_seconds())
            time.sleep(0.3)
    return out


def embedded_latency(tmp: Path, n: int) -> list[float]:
    """The SQLite embedded pool: re-queued (``updated_at``) -> claimed (``claimed_at``), polling."""
    from fastapi.testclient import TestClient

    from stepdoctor_server.web.app import create_app

    settings = Settings(data_dir=tmp / "embedded", workers=1)
    migrate.upgrade(settings)
    out = []
    app = create_app(settings)
    db = app.state.db
    with db.session() as s:
        team, _ = auth.get_or_create_team(s, "bench")
        token = auth.create_token(s, team, scope="admin", name="bench")[1]
    with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as client:
        trace_id = upload(client, (HTA_TRACES / GPU_FIXTURES[-1]).read_bytes(), run="lat").json()["id"]
        wait_for(lambda: all_done(db, [trace_id]))
        for _ in range(n):
            time.sleep(0.3)
            with db.session() as s:
                reset_to_pending(s, [trace_id])
            with db.session() as s:
                queued = s.scalar(select(Trace.updated_at).where(Trace.id == trace_id))
            wait_for(lambda: all_done(db, [trace_id]))
            with db.session() as s:
                claimed = s.scalar(select(Trace.claimed_at).where(Trace.id == trace_id))
            assert queued is not None and claimed is not None
            out.append((claimed - queued).total_seconds())
    return out


def upload_to_stored(
    env: dict[str, str], tmp: Path, token: str, repeat: int, *, shared_dir: bool
) -> dict[str, list[float]]:
    """POST the big trace -> its analysis stored; the worker shares the API's data dir only if told.

    Split into: the upload (POST -> 201: staging, validation, the store's commit), the wait for a
    worker (201 -> job started, procrastinate's event), the job (started -> stored, of which
    ``engine`` is the analysis itself: reading the trace from the store, parsing, diagnosing).
    """
    body = BIG.read_bytes()
    parts: dict[str, list[float]] = {"total": [], "upload": [], "to start": [], "job": [], "engine": []}
    events = text(
        "SELECT max(e.at) FILTER (WHERE e.type = 'started'), max(e.at) FILTER (WHERE e.type = 'deferred') "
        "FROM procrastinate_events e "
        "JOIN procrastinate_jobs j ON j.id = e.job_id WHERE j.lock = :lock"
    )
    with ExitStack() as stack:
        stack.enter_context(workers(1, env, tmp, own_data_dir=not shared_dir))
        api = stack.enter_context(serve_subprocess(env))
        db = Database(Settings(data_dir=tmp, database_url=env["STEPDOCTOR_DATABASE_URL"]))
        stack.callback(db.dispose)
        wait_for(lambda: live_workers(db) >= 1, 120, 0.1)
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=api.url, headers=headers, timeout=120) as client:
            for i in range(repeat + 1):  # the first one warms the worker's forkserver
                start = time.perf_counter()
                ids = [int(upload(client, body, run=f"big{i}-{time.monotonic_ns()}").json()["id"])]
                uploaded = time.perf_counter()
                wait_for(functools.partial(all_done, db, ids))
                done = time.perf_counter()
                if i == 0:
                    continue
                with db.session() as s:
                    started, deferred = s.execute(events, {"lock": f"trace:{ids[0]}"}).one()
                    engine_ms = s.scalar(select(Analysis.duration_ms).where(Analysis.trace_id == ids[0]))
                    stored = s.scalar(select(Trace.updated_at).where(Trace.id == ids[0]))
                parts["total"].append(done - start)
                parts["upload"].append(uploaded - start)
                parts["to start"].append((started - deferred).total_seconds())
                parts["job"].append((stored - started).total_seconds())
                parts["engine"].append((engine_ms or 0) / 1000)
    return parts


def measure_queue(
    args: argparse.Namespace, db: Database, s3_env: dict[str, str], tmp: Path, token: str
) -> None:
    """Parts 1 and 2: the batch is uploaded once through an API (workers 0), then re-queued."""
    # Upload the batch once through an API (workers 0), then measure analysis only.
    ids: list[int] = []
    with (
        serve_subprocess(
            {**s3_env, "STEPDOCTOR_DATA_DIR": str(tmp / "api"), "STEPDOCTOR_WORKERS": "0"}
        ) as api,
        httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as client,
    ):
        for c in range(args.copies):
            for rank, name in enumerate(GPU_FIXTURES):
                resp = upload(client, (HTA_TRACES / name).read_bytes(), run=f"batch{c}", rank=rank)
                ids.append(resp.json()["id"])
    with db.session() as s:  # the uploads queued jobs; drop them, each measurement re-queues
        s.execute(text("DELETE FROM procrastinate_jobs"))
    print(f"1. throughput: {len(ids)} fixture traces from S3, procrastinate on PostgreSQL")
    walls = {}
    for count in (1, 2) if "1" in args.parts else ():
        walls[count] = throughput(db, s3_env, tmp, ids, count)
        print(
            f"   {count} worker process(es): {walls[count]:6.2f} s  ({len(ids) / walls[count]:.2f} traces/s)"
        )
    if walls:
        print(f"   speed-up 2 vs 1: {walls[1] / walls[2]:.2f}x on {os.cpu_count()} CPU(s)")

    if "2" not in args.parts:
        return
    print("2. enqueue -> start latency (idle worker)")
    lat = procrastinate_latency(db, s3_env, tmp, ids[-1], 10)
    print(f"   procrastinate LISTEN/NOTIFY: {fmt(lat)}")
    print(f"   embedded pool (SQLite, polls every 0.2 s): {fmt(embedded_latency(tmp, 10))}")


def fmt(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:7.0f} ms  (min {min(values) * 1000:.0f}, max {max(values) * 1000:.0f}, n={len(values)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=1, help="copies of the GPU fixture batch")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--parts", default="123", help="which measurements to run, e.g. 3")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        server = stack.enter_context(running_weed(tmp))
        if isinstance(server, str):
            print(f"cannot run: {server}")
            return 1
        assert isinstance(server, S3Server)
        url = stack.enter_context(_fresh_postgres_database())
        settings = Settings(data_dir=tmp / "migrate", database_url=url)
        migrate.upgrade(settings)
        db = Database(settings)
        stack.callback(db.dispose)
        with db.session() as s:
            team, _ = auth.get_or_create_team(s, "default")
            token = auth.create_token(s, team, scope="admin", name="bench")[1]
        s3_env = {**server.env, "STEPDOCTOR_DATABASE_URL": url, "STEPDOCTOR_STORAGE_URL": server.fresh_url()}

        if "1" in args.parts or "2" in args.parts:
            measure_queue(args, db, s3_env, tmp, token)

        if "3" not in args.parts:
            return 0
        print("3. upload -> analysis stored, 34.8 MB trace (1.7 MB gzip) through the HTTP API, 1 worker")
        local_env = {
            "STEPDOCTOR_DATABASE_URL": url,
            "STEPDOCTOR_DATA_DIR": str(tmp / "shared"),
            "STEPDOCTOR_WORKERS": "0",
        }
        local = upload_to_stored(local_env, tmp, token, args.repeat, shared_dir=True)
        s3_api = {**s3_env, "STEPDOCTOR_DATA_DIR": str(tmp / "api2"), "STEPDOCTOR_WORKERS": "0"}
        s3 = upload_to_stored(s3_api, tmp, token, args.repeat, shared_dir=False)
        print(f"   {'median ms':<10}{'local dir':>12}{'S3':>12}{'S3/local':>10}")
        for part in local:
            a, b = statistics.median(local[part]), statistics.median(s3[part])
            print(f"   {part:<10}{a * 1000:>12.0f}{b * 1000:>12.0f}{b / a if a else float('nan'):>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
