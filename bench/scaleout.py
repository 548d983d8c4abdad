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
4. A job of N ranks end to end (``--ranks 8,128,1000``): N traces made from one real trace by
   rewriting its rank fields, one straggler injected, uploaded through the API to S3 while 2 worker
   processes analyse them; upload, analysis, aggregate and page times, their growth from one N to
   the next, and checks: every trace analysed exactly once, one final aggregate, the straggler found.

    .venv/bin/python bench/scaleout.py [--copies 1] [--repeat 3]
    .venv/bin/python bench/scaleout.py --parts 4 [--ranks 8,128,1000]
"""

from __future__ import annotations

import argparse
import functools
import gzip
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests")]

import httpx  # noqa: E402
from sqlalchemy import func, select, text  # noqa: E402

from stepdoctor_server.auth import tokens as auth  # noqa: E402
from stepdoctor_server.core import migrate  # noqa: E402
from stepdoctor_server.core.database import Database  # noqa: E402
from stepdoctor_server.core.models import Analysis, Run, Trace  # noqa: E402
from stepdoctor_server.core.settings import Settings  # noqa: E402
from stepdoctor_server.jobs.claims import reset_to_pending  # noqa: E402
from support.fixtures import GPU_FIXTURES, HTA_TRACES  # noqa: E402
from support.s3 import S3Server, running_weed  # noqa: E402
from support.server import _fresh_postgres_database, serve_subprocess, upload  # noqa: E402

BIG = HTA_TRACES / "trace_diff" / "control" / "control.json.gz"
# Part 4's rank trace: a real 128-rank NCCL job's rank 0 (2 profiled steps, 4,855 events,
# 124 KB gzip, 1.8 MB of JSON), its ``distributedInfo`` rank and world size rewritten per rank.
RANK_TRACE = HTA_TRACES / "trace_filter" / "sampled_rank-0.json.gz"
SLOWDOWN = 1.3
RANKS_PER_HOST = 8
PAGE_TARGET_MS = 300.0


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


# -- part 4: a job of N ranks -------------------------------------------------------------------


def slowed(doc: dict[str, Any], factor: float) -> dict[str, Any]:
    """The trace of a rank ``factor`` times slower at everything but its collectives: every event's
    start and length stretched from the trace's first timestamp (kernels, CPU ops, its steps), the
    NCCL kernels kept at their length. Its work before each collective grows by ``factor``."""
    events = doc["traceEvents"]
    t0 = min(e["ts"] for e in events if isinstance(e.get("ts"), int | float))
    out = []
    for e in events:
        if isinstance(e.get("ts"), int | float):
            e = dict(e)
            e["ts"] = t0 + (e["ts"] - t0) * factor
            nccl = e.get("cat") == "kernel" and "nccl" in str(e.get("name", "")).lower()
            if isinstance(e.get("dur"), int | float) and not nccl:
                e["dur"] = e["dur"] * factor
        out.append(e)
    return {**doc, "traceEvents": out}


def rank_job(ranks: int, slow: int) -> list[bytes]:
    """``ranks`` gzipped traces of one job, rank ``slow`` slowed (``slowed``); the others differ from
    the real trace only in ``distributedInfo`` (dumped once, the rank written into the text)."""
    doc = json.loads(gzip.decompress(RANK_TRACE.read_bytes()))
    marker = 987_654_321

    def text(d: dict[str, Any]) -> str:
        info = {**d["distributedInfo"], "rank": marker, "world_size": ranks}
        return json.dumps({**d, "distributedInfo": info})

    plain, late = text(doc), text(slowed(doc, SLOWDOWN))
    return [
        gzip.compress(
            (late if r == slow else plain).replace(str(marker), str(r), 1).encode(), compresslevel=1
        )
        for r in range(ranks)
    ]


@dataclass
class JobFigures:
    ranks: int
    upload_s: float  # first POST -> last 201
    analysed_s: float  # first POST -> every trace done
    after_upload_s: float  # last 201 -> every trace done
    aggregate_s: float  # last analysis stored -> the final diagnosis computed (database clocks)
    page_ms: float  # run page, median server round trip
    twin_ms: float  # its JSON twin, /api/v1/runs/{id}/diagnosis
    engine_ms: float  # median analysis time of one trace, in the worker
    aggregations: int  # times the run's diagnosis was computed in all
    checks: dict[str, bool]


def run_job(
    ranks: int, db: Database, s3_env: dict[str, str], tmp: Path, token: str, reader: str
) -> JobFigures:
    """Part 4 for one N: upload (4 client threads) while 2 ``stepdoctor worker`` processes analyse."""
    slow = min(ranks - 1, int(0.613 * ranks))  # rank 613 of 1,000, at the same place for fewer
    bodies = rank_job(ranks, slow)
    run = f"ranks-{ranks}-{time.monotonic_ns()}"
    api_env = {**s3_env, "STEPDOCTOR_DATA_DIR": str(tmp / f"api-{ranks}"), "STEPDOCTOR_WORKERS": "0"}
    with ExitStack() as stack:
        stack.enter_context(workers(2, s3_env, tmp))
        api = stack.enter_context(serve_subprocess(api_env))
        wait_for(lambda: live_workers(db) >= 2, 120, 0.1)
        client = stack.enter_context(
            httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}, timeout=300)
        )

        def send(rank: int) -> int:
            meta = {"host": f"node-{rank // RANKS_PER_HOST:03d}", "pid": 1000 + rank % RANKS_PER_HOST}
            resp = upload(client, bodies[rank], project="scale", run=run, rank=rank, metadata=meta)
            assert resp.status_code == 201, (rank, resp.status_code, resp.text[:300])
            return int(resp.json()["id"])

        start = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            ids = list(pool.map(send, range(ranks)))
        uploaded = time.perf_counter()
        wait_for(functools.partial(all_done, db, ids), 3600, 0.2)
        analysed = time.perf_counter()
        with db.session() as s:
            run_id = int(s.scalar(select(Trace.run_id).where(Trace.id == ids[0])) or 0)
        wait_for(lambda: _final(db, run_id, ranks), 600, 0.2)
        time.sleep(3.0)  # anything still to come (a late aggregation) would show now
        page_ms, twin_ms = _page_times(api.url, run_id, reader)
        with db.session() as s:
            run_row = s.get(Run, run_id)
            assert run_row is not None
            diagnosis, aggregations = dict(run_row.diagnosis or {}), int(run_row.aggregations)
            last_stored = s.scalar(
                select(func.max(Analysis.created_at)).join(Trace).where(Trace.run_id == run_id)
            )
            engine = s.scalars(select(Analysis.duration_ms).join(Trace).where(Trace.run_id == run_id)).all()
            checks = _checks(s, run_id, ids, diagnosis, slow)
    computed = datetime.fromisoformat(str(diagnosis["computed_at"]))
    assert last_stored is not None
    if last_stored.tzinfo is None:
        last_stored = last_stored.replace(tzinfo=computed.tzinfo)
    return JobFigures(
        ranks=ranks,
        upload_s=uploaded - start,
        analysed_s=analysed - start,
        after_upload_s=analysed - uploaded,
        aggregate_s=max(0.0, (computed - last_stored).total_seconds()),
        page_ms=page_ms,
        twin_ms=twin_ms,
        engine_ms=statistics.median(e or 0 for e in engine),
        aggregations=aggregations,
        checks=checks,
    )


def _final(db: Database, run_id: int, ranks: int) -> bool:
    """The run's stored diagnosis covers every trace and no aggregation is queued or running."""
    with db.session() as s:
        diagnosis = s.scalar(select(Run.diagnosis).where(Run.id == run_id)) or {}
        queued = s.scalar(
            text("SELECT count(*) FROM procrastinate_jobs WHERE lock = :l AND status IN ('todo', 'doing')"),
            {"l": f"run:{run_id}"},
        )
    return diagnosis.get("traces") == ranks and not diagnosis.get("pending") and not queued


def _checks(s: Any, run_id: int, ids: list[int], diagnosis: dict[str, Any], slow: int) -> dict[str, bool]:
    from stepdoctor_server.runs.diagnosis_job import refresh_run_diagnosis

    jobs = dict(
        s.execute(
            text(
                "SELECT lock, count(*) FILTER (WHERE status = 'succeeded') FROM procrastinate_jobs "
                "WHERE lock = ANY(:locks) GROUP BY lock"
            ),
            {"locks": [f"trace:{i}" for i in ids]},
        ).all()
    )
    attempts = s.scalars(select(Trace.attempts).where(Trace.run_id == run_id)).all()
    analyses = s.scalar(select(func.count(Analysis.id)).join(Trace).where(Trace.run_id == run_id))
    late = [st.get("rank") for st in diagnosis.get("stragglers", [])]
    return {
        "every trace analysed exactly once": len(jobs) == len(ids)
        and set(jobs.values()) == {1}
        and set(attempts) == {1}
        and analyses == len(ids),
        "one final aggregate (up to date, nothing new to fold)": diagnosis.get("traces") == len(ids)
        and refresh_run_diagnosis(s, run_id, force=False) is None,
        f"straggler found (rank {slow}, and only it)": late == [slow],
    }


def _page_times(url: str, run_id: int, reader: str, repeat: int = 7) -> tuple[float, float]:
    """Median round trip of the run page (logged in) and of its JSON twin, after one warm-up each."""
    out = []
    with httpx.Client(base_url=url, timeout=120) as browser:
        login = browser.post(
            "/login",
            content=f"token={reader}&next=/",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
            follow_redirects=False,
        )
        assert login.status_code == 303, login.text[:300]
        for path, headers in (
            (f"/runs/{run_id}", {}),
            (f"/api/v1/runs/{run_id}/diagnosis", {"Authorization": f"Bearer {reader}"}),
        ):
            times = []
            for _ in range(repeat + 1):
                t = time.perf_counter()
                resp = browser.get(path, headers=headers)
                times.append((time.perf_counter() - t) * 1000.0)
                assert resp.status_code == 200, (path, resp.status_code, resp.text[:300])
            out.append(statistics.median(times[1:]))
    return out[0], out[1]


def measure_ranks(
    sizes: list[int], db: Database, s3_env: dict[str, str], tmp: Path, token: str, reader: str
) -> None:
    print(
        f"4. a job of N ranks: {RANK_TRACE.relative_to(HTA_TRACES)} ({RANK_TRACE.stat().st_size / 1e3:.0f} KB gzip) "
        f"per rank, rank 0.613 N slowed {SLOWDOWN:.1f}x; PostgreSQL + S3 (weed mini), API "
        f"(serve --workers 0) + 2 worker processes, 4 upload threads, on {os.cpu_count()} CPU(s)"
    )
    rows = []
    for n in sizes:
        figures = run_job(n, db, s3_env, tmp, token, reader)
        rows.append(figures)
        status = ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in figures.checks.items())
        print(
            f"   {n:>5} ranks: upload {figures.upload_s:6.1f} s, analysed {figures.analysed_s:6.1f} s after the "
            f"first upload ({figures.after_upload_s:5.1f} s after the last), aggregate {figures.aggregate_s:5.2f} s "
            f"after the last analysis ({figures.aggregations} aggregations in all), run page "
            f"{figures.page_ms:5.0f} ms, JSON twin {figures.twin_ms:4.0f} ms; engine {figures.engine_ms:.0f} ms/trace"
        )
        print(f"          {status}")
    print(f"   {'stage':<34}" + "".join(f"{r.ranks:>10}" for r in rows) + "   growth per step (x ranks)")
    stages = {
        "upload, s": [r.upload_s for r in rows],
        "analysis (from first upload), s": [r.analysed_s for r in rows],
        "aggregate (after last analysis), s": [r.aggregate_s for r in rows],
        "run page, ms": [r.page_ms for r in rows],
        "JSON twin, ms": [r.twin_ms for r in rows],
    }
    for label, values in stages.items():
        growth = ", ".join(
            f"{b / a:.1f}x ({rows[i + 1].ranks / rows[i].ranks:.0f}x)" if a > 0 else "-"
            for i, (a, b) in enumerate(itertools.pairwise(values))
        )
        print(f"   {label:<34}" + "".join(f"{v:>10.2f}" for v in values) + f"   {growth}")
    over = [r.ranks for r in rows if r.page_ms >= PAGE_TARGET_MS]
    failed = [f"{r.ranks}: {k}" for r in rows for k, ok in r.checks.items() if not ok]
    print(f"   run page within {PAGE_TARGET_MS:.0f} ms: {'yes' if not over else f'NO at {over} ranks'}; checks: "
          f"{'all passed' if not failed else 'FAILED ' + '; '.join(failed)}")  # fmt: skip


def fmt(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:7.0f} ms  (min {min(values) * 1000:.0f}, max {max(values) * 1000:.0f}, n={len(values)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=1, help="copies of the GPU fixture batch")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--parts", default="123", help="which measurements to run, e.g. 3 or 4")
    parser.add_argument("--ranks", default="8,128,1000", help="part 4's job sizes, comma-separated")
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

        if "4" in args.parts:
            with db.session() as s:
                reader = auth.create_token(s, s.merge(team), scope="read", name="bench-read")[1]
            measure_ranks([int(n) for n in args.ranks.split(",")], db, s3_env, tmp, token, reader)

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
