"""The analysis job: one stored trace through the engine, in a child process under the job's time
and memory limits, its report stored (or its failure, with the reason users see).

Registered with the job engine (``jobs.defer``): ``ANALYZE`` for procrastinate's deliveries, and a
claimer for the embedded pool. After a trace is done, the hooks in ``TRACE_DONE`` run (the run's
diagnosis refresh, ``runs.diagnosis_job``), so this module imports no other domain.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from sqlalchemy import select

from stepdoctor_server.core.database import Database
from stepdoctor_server.core.models import Trace
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.jobs.claims import AnalysisResult, SqlJobQueue
from stepdoctor_server.jobs.defer import (
    ANALYZE,
    CLAIMERS,
    TRACE_DONE,
    JobContext,
    TransientJobError,
    handles,
    retry_wait_s,
)
from stepdoctor_server.jobs.limits import JobFailed, run_limited
from stepdoctor_server.jobs.pool import _observe, describe_error, retry_db
from stepdoctor_server.traces.storage import make_store

log = logging.getLogger("stepdoctor.worker")


def analyze_stored(
    settings_json: str,
    storage_key: str,
    filename: str,
    metadata: dict[str, Any],
    aws_env: dict[str, str] | None = None,
) -> AnalysisResult:
    """Stream one stored trace from the store and run the engine (in the job's child process).

    ``aws_env`` is the worker's ``AWS_*`` environment: the child descends from a forkserver
    started earlier, whose environment may predate the worker's.
    """
    from stepdoctor_analysis import parsing as parse
    from stepdoctor_analysis import pipeline
    from stepdoctor_analysis.report import contract

    if aws_env is not None:
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            del os.environ[name]
        os.environ.update(aws_env)
    settings = Settings.model_validate_json(settings_json)
    start = time.perf_counter()
    with make_store(settings).open(storage_key) as stream:
        trace = parse.load_trace(stream, max_bytes=settings.max_decompressed_bytes, name=filename)
    # The upload's run metadata (loader settings, CPU count, host RAM) lets recommendations name exact
    # values; the engine merges it with what the trace embeds, as ``stepdoctor analyze`` does.
    report = pipeline.analyze_trace(trace, metadata=metadata or None).to_dict()
    # Stored as the engine wrote it, once it decoded as the contract: readers decode it typed too.
    doc = contract.decode(report)
    duration_ms = int((time.perf_counter() - start) * 1000)
    return AnalysisResult(
        engine_version=doc.engine_version,
        schema_version=doc.schema_version,
        primary_kind=doc.primary.kind,
        primary_share=doc.primary.share,
        report=report,
        duration_ms=duration_ms,
    )


def analyze_limited(
    settings: Settings, storage_key: str, filename: str, metadata: dict[str, Any]
) -> AnalysisResult:
    """``analyze_stored`` in a child process under the job time and memory limits (JobFailed past them)."""
    result: AnalysisResult = run_limited(
        analyze_stored,
        (settings.model_dump_json(), storage_key, filename, metadata, _aws_env()),
        timeout_s=settings.job_timeout_s,
        memory_bytes=settings.job_memory_limit_bytes,
        describe_error=describe_error,
    )
    return result


def _aws_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith("AWS_")}


@dataclass(frozen=True)
class _TraceJob:
    run_id: int
    storage_key: str
    filename: str
    meta: dict[str, Any]


def _load_job(db: Database, trace_id: int) -> _TraceJob | None:
    with db.session() as session:
        row = session.execute(
            select(Trace.run_id, Trace.storage_key, Trace.filename, Trace.meta).where(Trace.id == trace_id)
        ).first()
    return None if row is None else _TraceJob(row[0], row[1], row[2], dict(row[3] or {}))


def _gave_up(tries: int, reason: str) -> str:
    return f"{reason} ({tries} tries with backoff); reanalyse the trace once it is back"


def handle_trace(
    db: Database,
    queue: SqlJobQueue,
    settings: Settings,
    trace_id: int,
    worker_id: str,
    metrics: Any = None,
    *,
    delivery: int | None = None,
) -> int | None:
    """Analyse a claimed trace and store the outcome; returns its run id (None if the row is gone).

    A bad trace, a time or memory limit fails the job with its reason; an unreachable database is
    retried (TransientJobError past the patience), never recorded as the trace's failure. An
    unreachable trace store is tried again ``settings.analysis_tries`` times in all, with backoff:
    in this process (``delivery`` None, the embedded pool), or, for the ``delivery``-th (0-based)
    delivery of a procrastinate job, by putting the trace back to pending and raising
    TransientJobError so procrastinate schedules the job again (``procrastinate_app``).
    """
    job = retry_db(lambda: _load_job(db, trace_id), what=f"trace {trace_id}")
    if job is None:
        return None
    started = time.perf_counter()
    tries = 0 if delivery is None else delivery
    try:
        while True:
            tries += 1
            try:
                result = analyze_limited(settings, job.storage_key, job.filename, job.meta)
                break
            except JobFailed as exc:
                if not exc.transient or tries >= settings.analysis_tries:
                    raise
                wait = retry_wait_s(settings, tries)
                log.warning(
                    "trace %s: %s (try %d of %d); again in %.0f s",
                    trace_id,
                    exc,
                    tries,
                    settings.analysis_tries,
                    wait,
                )
                note = f"waiting to retry: {exc} (try {tries} of {settings.analysis_tries})"
                if delivery is not None:
                    retry_db(partial(queue.release, trace_id, note, worker_id), what=f"trace {trace_id}")
                    raise TransientJobError(f"trace {trace_id}: {exc}") from None
                retry_db(partial(queue.note, trace_id, note, worker_id), what=f"trace {trace_id}")
                time.sleep(wait)
    except TransientJobError:
        raise
    except Exception as exc:  # JobFailed, or the child could not even start (fork failed, ...)
        reason = str(exc) if isinstance(exc, JobFailed) else describe_error(exc)[0]
        if isinstance(exc, JobFailed) and exc.transient:
            reason = _gave_up(tries, reason)
        if not isinstance(exc, JobFailed):
            log.exception("trace %s: %s", trace_id, reason)
        elif exc.internal:
            log.error("trace %s: %s\n%s", trace_id, reason, exc.details)
        else:
            log.info("trace %s: %s", trace_id, reason)
        ended = retry_db(lambda: queue.fail(trace_id, reason, worker_id), what=f"trace {trace_id}")
        _observe(metrics, "analyze", "failed" if ended else "superseded", started, reason)
        return job.run_id
    stored = retry_db(lambda: queue.complete(trace_id, result, worker_id), what=f"trace {trace_id}")
    if stored:
        log.info("trace %s: %s in %d ms", trace_id, result.primary_kind, result.duration_ms)
    else:
        log.warning("trace %s: job was taken over or reset meanwhile; this result is not stored", trace_id)
    _observe(metrics, "analyze", "done" if stored else "superseded", started)
    return job.run_id


def claim_and_analyze(job: JobContext) -> bool:
    """The embedded pool's claimer: the oldest pending trace, analysed; False when none waits."""
    queue = job.queue if isinstance(job.queue, SqlJobQueue) else SqlJobQueue(job.db)
    trace_id = queue.claim(job.worker_id)
    if trace_id is None:
        return False
    run_id = handle_trace(job.db, queue, job.settings, trace_id, job.worker_id)
    if run_id is not None:
        for hook in TRACE_DONE:
            hook(job.db, run_id)
    return True


CLAIMERS.insert(0, claim_and_analyze)  # traces before any other domain's jobs


@handles(ANALYZE)
def run_delivered_trace(runtime: Any, trace_id: int, delivery: int = 0) -> None:
    """Body of procrastinate's ``analyze_trace`` job: claim that trace, analyse, store.

    A delivery finding the trace done or failed (a duplicate) does nothing. ``delivery``: how many
    times procrastinate ran this job before (its retries after an unreachable store).
    """
    queue = SqlJobQueue(runtime.db)
    if not retry_db(lambda: queue.claim_trace(trace_id, runtime.worker_id), what=f"trace {trace_id}"):
        log.info("trace %s: already analysed or gone; nothing to do", trace_id)
        return
    handle_trace(
        runtime.db, queue, runtime.settings, trace_id, runtime.worker_id, runtime.metrics, delivery=delivery
    )
