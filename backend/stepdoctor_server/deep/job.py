"""The deep-analysis job: HTA's critical path of a stored trace, run by whichever worker is idle.

Registered with the job engine (``jobs.defer``): ``DEEP`` for procrastinate's periodic drain, and
a claimer after the traces' for the embedded pool (deep jobs run only when no trace waits).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select

from stepdoctor_server.core.database import Database
from stepdoctor_server.core.models import DeepAnalysis, Trace
from stepdoctor_server.jobs.claims import SqlDeepQueue
from stepdoctor_server.jobs.defer import CLAIMERS, DEEP, JobContext, handles
from stepdoctor_server.jobs.pool import failure_reason, retry_db
from stepdoctor_server.traces.storage import TraceStore, make_store

log = logging.getLogger("stepdoctor.worker")


def _logged_reason(exc: BaseException, path: Path | None, filename: str, job: str) -> str:
    """The failure reason users see, logged: with the traceback only when it is our own bug."""
    reason = failure_reason(exc)
    if path is not None:  # users know the file by its download name, not by our storage key
        reason = reason.replace(str(path), filename).replace(path.name, filename)
    if reason.startswith("internal error"):
        log.exception("%s: failed", job)
    else:
        log.info("%s: %s", job, reason)
    return reason


def run_deep(kind: str, params: dict[str, Any], path: Path, rank: int | None) -> dict[str, Any]:
    """Run one deep analysis on a stored trace file (HTA missing: a one-line TraceError)."""
    from stepdoctor_analysis.analyzers import deep

    if kind == "critical_path":
        step = params.get("step")
        return deep.critical_path(path, rank=rank, step=step if isinstance(step, int) else None)
    raise ValueError(f"unknown deep analysis kind {kind!r}")


@handles(DEEP)
def drain_deep(runtime: Any) -> None:
    """Body of procrastinate's periodic ``deep_analyses``: drain the optional HTA jobs."""
    queue, store = SqlDeepQueue(runtime.db), make_store(runtime.settings)
    while process_one_deep(runtime.db, queue, store, runtime.worker_id):
        pass


def process_one_deep(db: Database, queue: SqlDeepQueue, store: TraceStore, worker_id: str) -> bool:
    """Claim and handle one deep-analysis job; False when there was none.

    A failing analysis fails its job; the database going away is waited out (``retry_db``), never
    recorded as the job's failure.

    HTA reads files by path, so a trace in object storage is copied to a temporary file first.
    """
    job_id = queue.claim(worker_id)
    if job_id is None:
        return False
    what = f"deep job {job_id}"

    def load() -> tuple[str, dict[str, Any], int | None, str, str]:
        with db.session() as session:
            job, trace = session.execute(
                select(DeepAnalysis, Trace)
                .join(Trace, Trace.id == DeepAnalysis.trace_id)
                .where(DeepAnalysis.id == job_id)
            ).one()
            return job.kind, dict(job.params or {}), trace.rank, trace.storage_key, trace.filename

    kind, params, rank, key, filename = retry_db(load, what=what)
    path: Path | None = None
    start = time.perf_counter()
    try:
        with store.local_copy(key) as path:
            result = run_deep(kind, params, path, rank)
            if result.get("source") == path.name:
                result["source"] = filename
    except Exception as exc:  # one bad job fails itself, never the worker
        reason = _logged_reason(exc, path, filename, what)
        retry_db(lambda: queue.fail(job_id, reason), what=what)
        return True
    retry_db(lambda: queue.complete(job_id, result), what=what)
    log.info("deep %s %s: done in %.1f s", kind, job_id, time.perf_counter() - start)
    return True


def claim_deep(job: JobContext) -> bool:
    """The embedded pool's claimer for deep analyses."""
    store = job.store if job.store is not None else make_store(job.settings)
    return process_one_deep(job.db, SqlDeepQueue(job.db), store, job.worker_id)


CLAIMERS.append(claim_deep)
