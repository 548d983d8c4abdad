"""Distributed jobs on procrastinate (PostgreSQL): analysis, run aggregation, liveness sweeps.

Used when the database is PostgreSQL (``STEPDOCTOR_JOB_ENGINE=auto``). Procrastinate brings what
a home-made queue lacked: worker heartbeats, LISTEN/NOTIFY wake-up, retries with backoff,
locks and queueing locks, periodic tasks, and no extra service. The ``traces`` table still
holds each trace's user-facing state (pending/running/done/failed); procrastinate delivers work.

- ``stepdoctor.analyze_trace(trace_id)``: deferred by the upload's own transaction (the job row
  commits with the trace row, so none is lost or orphaned). ``lock`` and ``queueing_lock``
  ``trace:N`` mean at most one delivery runs and one waits; the claim in ``traces`` and the
  ``claimed_by`` guard on completion mean a second delivery never stores a second analysis.
- ``stepdoctor.aggregate_run(run_id)``: deferred by the transaction that ends a trace and
  serialised per run by its lock. It aggregates once no trace of the run is waiting, and skips
  when the inputs are those of the stored diagnosis, so a run is aggregated once.
- Stalled-job retry: every worker checks every few seconds (in its event loop, not as a job, so
  busy job slots never delay it) for jobs of workers whose heartbeat is older than
  ``STEPDOCTOR_WORKER_STALLED_AFTER_S`` (killed, hung, host gone) and puts them back.
- ``stepdoctor.sweep_pending`` (every 30 s): the outbox safety net; a pending trace without a
  waiting job (written by an older version, or reset by hand) gets one, and a running trace whose
  job is gone for good (retries exhausted) is requeued, or failed after ``MAX_ATTEMPTS``.
- ``stepdoctor.deep_analyses`` (every 5 s): drains the optional HTA jobs of ``deep_analyses``.
- ``stepdoctor.webhooks`` (every 5 s): sends the due regression webhooks of ``webhook_deliveries``
  (their backoff lives in the rows, so a worker never sleeps between tries).

The analysis itself runs in a child process under the job's time and memory limits (``limits``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from stepdoctor_server.core.database import Database
from stepdoctor_server.core.models import Trace
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.jobs.claims import requeue_or_give_up
from stepdoctor_server.jobs.defer import (
    AGGREGATE,
    ANALYZE,
    DEEP,
    HANDLERS,
    QUEUE_AGGREGATION,
    QUEUE_ANALYSIS,
    QUEUE_DEEP,
    QUEUE_WEBHOOKS,
    WEBHOOKS,
    TransientJobError,
    defer_analyses,
    retry_wait_s,
    run_sweeps,
)

log = logging.getLogger("stepdoctor.jobs")


def libpq_url(database_url: str) -> str:
    """The SQLAlchemy URL as a libpq connection URI (what procrastinate's psycopg connector takes)."""
    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)


def queue_depth(session: Session) -> dict[str, int]:
    """Jobs waiting per queue (``todo``), for metrics."""
    rows = session.execute(
        text("SELECT queue_name, count(*) FROM procrastinate_jobs WHERE status = 'todo' GROUP BY queue_name")
    ).all()
    return {str(q): int(n) for q, n in rows}


# -- the procrastinate application ---------------------------------------------------------------


@dataclass
class Runtime:
    """What tasks need, handed to them through procrastinate's ``additional_context``."""

    settings: Settings
    db: Any
    worker_id: str
    metrics: Any = None


def make_app(settings: Settings) -> Any:
    """A procrastinate App on ``settings.database_url`` with our tasks registered."""
    import procrastinate

    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=libpq_url(settings.database_url.get_secret_value()))
    )
    app.add_tasks_from(_blueprint(settings), namespace="")
    return app


def _transient_retry(settings: Settings) -> Any:
    """Retry only transient trouble (TransientJobError: the database or the trace store away),
    waiting ``defer.retry_wait_s`` (the embedded pool's backoff) between deliveries. A bad trace
    fails once, with its reason stored in ``traces``; ``handle_trace`` fails the trace itself
    after ``settings.analysis_tries`` tries on an unreachable store, within these attempts."""
    from procrastinate import BaseRetryStrategy, RetryDecision

    max_attempts = max(10, settings.analysis_tries)

    class Backoff(BaseRetryStrategy):
        def get_retry_decision(self, *, exception: BaseException, job: Any) -> Any:
            if not isinstance(exception, TransientJobError) or job.attempts >= max_attempts:
                return None
            wait = timedelta(seconds=retry_wait_s(settings, job.attempts + 1))
            return RetryDecision(retry_at=datetime.now(timezone.utc) + wait)

    return Backoff()


def _blueprint(settings: Settings) -> Any:
    import procrastinate

    bp = procrastinate.Blueprint()
    transient = _transient_retry(settings)

    @bp.task(name=ANALYZE, queue=QUEUE_ANALYSIS, pass_context=True, retry=transient)
    def analyze_trace(context: Any, trace_id: int) -> None:
        HANDLERS[ANALYZE](
            context.additional_context["runtime"], trace_id, delivery=int(context.job.attempts or 0)
        )

    @bp.task(name=AGGREGATE, queue=QUEUE_AGGREGATION, pass_context=True, retry=transient)
    def aggregate_run(context: Any, run_id: int) -> None:
        HANDLERS[AGGREGATE](context.additional_context["runtime"], run_id)

    @bp.periodic(cron="* * * * * */30", periodic_id="pending")
    @bp.task(name="stepdoctor.sweep_pending", queue=QUEUE_AGGREGATION, pass_context=True)
    def sweep_pending(context: Any, timestamp: int) -> None:
        runtime: Runtime = context.additional_context["runtime"]
        no_live_job = (
            "NOT EXISTS (SELECT 1 FROM procrastinate_jobs j WHERE j.lock = 'trace:' || t.id "
            "AND j.status IN ('todo', 'doing'))"
        )
        run_sweeps(runtime.db)  # e.g. reports another engine wrote: redone by this job, not by a GET
        with runtime.db.session() as session:
            # Running with no delivery left (its job failed for good, e.g. retries exhausted
            # during a long outage): back to pending, or failed after MAX_ATTEMPTS.
            orphans = session.scalars(
                text(
                    "SELECT t.id FROM traces t WHERE t.status = 'running' "
                    f"AND t.claimed_at < now() - interval '60 seconds' AND {no_live_job}"
                )
            ).all()
            if orphans:
                log.warning("%d running trace(s) had no live job; requeued", len(orphans))
                requeue_or_give_up(session, Trace, orphans)
            ids = session.scalars(
                text(
                    "SELECT t.id FROM traces t WHERE t.status = 'pending' "
                    f"AND (t.updated_at < now() - interval '10 seconds' OR t.id = ANY(:orphans)) AND {no_live_job}"
                ),
                {"orphans": list(orphans)},
            ).all()
            if ids:
                log.info("queueing %d pending trace(s) that had no job", len(ids))
                defer_analyses(session, ids)

    @bp.periodic(cron="* * * * * */5", periodic_id="deep")
    @bp.task(name=DEEP, queue=QUEUE_DEEP, pass_context=True)
    def deep_analyses(context: Any, timestamp: int) -> None:
        """Optional HTA analyses stay rows of ``deep_analyses`` (claimed like the embedded pool
        does): whichever worker runs this tick drains them, one claim at a time."""
        HANDLERS[DEEP](context.additional_context["runtime"])

    @bp.periodic(cron="* * * * * */5", periodic_id="webhooks")
    @bp.task(name=WEBHOOKS, queue=QUEUE_WEBHOOKS, pass_context=True)
    def webhooks(context: Any, timestamp: int) -> None:
        """Regression webhooks stay rows of ``webhook_deliveries`` (claimed like the pool does)."""
        if WEBHOOKS in HANDLERS:
            HANDLERS[WEBHOOKS](context.additional_context["runtime"])

    return bp


# -- the worker process --------------------------------------------------------------------------


class _NoTransientTraceback(logging.Filter):
    """Drop the traceback from procrastinate's job-outcome line when the job failed for an outage
    (TransientJobError): the worker already logged the cause in one line, and the job is retried."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], TransientJobError):
            record.exc_info, record.exc_text = None, None
        return True


class _StateLog:
    """One log line per change of the database's reachability, never one per retry."""

    def __init__(self) -> None:
        self.down_since: float | None = None

    def failed(self, exc: BaseException, retry_in: float) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning(
                "database unreachable (%s); retrying with backoff up to %.0f s", _short(exc), retry_in
            )

    def ok(self) -> None:
        if self.down_since is not None:
            log.warning("database reachable again after %.0f s", time.monotonic() - self.down_since)
            self.down_since = None


def _short(exc: BaseException) -> str:
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def run_worker(
    settings: Settings,
    *,
    concurrency: int,
    name: str,
    stop: threading.Event | Any,
    metrics: Any = None,
    watch_parent: bool = False,
) -> None:
    """Run one procrastinate worker (``concurrency`` jobs at a time) until ``stop`` is set.

    When the database goes away the worker is restarted with exponential backoff (0.5 s to 30 s)
    and one log line per state change, never a traceback per poll.
    """
    # psycopg's pool warns on every reconnect attempt; the outage is reported once, below.
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    # A job retried for an outage gets procrastinate's one line, without a traceback.
    outcome_log = logging.getLogger("procrastinate.worker")
    if not any(isinstance(f, _NoTransientTraceback) for f in outcome_log.filters):
        outcome_log.addFilter(_NoTransientTraceback())
    db = Database(settings)
    app = make_app(settings)
    runtime = Runtime(settings=settings, db=db, worker_id=name, metrics=metrics)
    state = _StateLog()
    backoff = 0.5
    try:
        while not stop.is_set():
            started = time.monotonic()
            try:
                db.ping()  # cheap probe before procrastinate opens its pool and listener
                asyncio.run(_serve(app, settings, runtime, concurrency, name, stop, state, watch_parent))
                return
            except Exception as exc:
                if time.monotonic() - started > 60:
                    backoff = 0.5  # it ran fine for a while: this is a new outage
                state.failed(exc, 30.0)
                log.debug("worker loop ended", exc_info=True)
                stop.wait(backoff)
                backoff = min(30.0, backoff * 2)
    finally:
        db.dispose()


async def _serve(
    app: Any,
    settings: Settings,
    runtime: Runtime,
    concurrency: int,
    name: str,
    stop: Any,
    state: _StateLog,
    watch_parent: bool,
) -> None:
    async with app.open_async():
        await app.check_connection_async()
        state.ok()
        worker = asyncio.create_task(
            app.run_worker_async(
                name=name,
                concurrency=concurrency,
                additional_context={"runtime": runtime},
                install_signal_handlers=False,
                update_heartbeat_interval=settings.worker_heartbeat_s,
                stalled_worker_timeout=settings.worker_stalled_after_s,
                listen_notify=True,
                fetch_job_polling_interval=settings.job_poll_interval_s,
                shutdown_graceful_timeout=10.0,
            )
        )
        sweeper = asyncio.create_task(_retry_stalled_forever(app, settings))
        parent = os.getppid()
        while not worker.done():
            # A pool child whose parent was SIGKILLed cannot be stopped by it: exit instead.
            if stop.is_set() or (watch_parent and os.getppid() != parent):
                worker.cancel()
                break
            await asyncio.sleep(0.2)
        sweeper.cancel()
        try:
            await worker
        except asyncio.CancelledError:
            return


async def _retry_stalled_forever(app: Any, settings: Settings) -> None:
    """Requeue the jobs of workers whose heartbeat stopped (SIGKILL, hang, lost host).

    Every worker runs this; two of them retrying one job is harmless (the second finds it no
    longer ``doing``). The job's own lock keeps the trace from running twice at once.
    """
    interval = max(0.5, min(5.0, settings.worker_stalled_after_s / 3))
    manager = app.job_manager
    while True:
        await asyncio.sleep(interval)
        try:
            stalled = await manager.get_stalled_jobs(seconds_since_heartbeat=settings.worker_stalled_after_s)
            for job in stalled:
                log.warning(
                    "job %s (%s %s) lost its worker; queueing it again",
                    job.id,
                    job.task_name,
                    job.task_kwargs,
                )
                try:
                    await manager.retry_job(job)
                except Exception as exc:  # another worker retried it first
                    log.debug("job %s: not retried: %s", job.id, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the database is away: the worker loop reports that once
            log.debug("stalled-job check failed: %s", exc)
