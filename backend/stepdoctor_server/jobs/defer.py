"""Deferring jobs inside the caller's transaction, and the handlers that run them.

The job rows go into procrastinate's table by the caller's own commit (no procrastinate import
needed), so an accepted upload is never without its job and a rolled-back one never has one.
The domains register what each task runs (``HANDLERS``), what the embedded pool claims
(``CLAIMERS``), what follows a stored trace (``TRACE_DONE``) and the sweeps (``SWEEPS``), from their
job modules (``traces.analysis_job``, ``runs.diagnosis_job``, ``deep.job``; imported together by
``stepdoctor_server.job_handlers``): the job engine calls them and imports no domain.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

ANALYZE = "stepdoctor.analyze_trace"
DEEP = "stepdoctor.deep_analyses"
AGGREGATE = "stepdoctor.aggregate_run"
WEBHOOKS = "stepdoctor.webhooks"
QUEUE_ANALYSIS = "analysis"
QUEUE_AGGREGATION = "aggregation"
QUEUE_DEEP = "deep"
QUEUE_WEBHOOKS = "webhooks"

_DEFER = text(
    "SELECT procrastinate_defer_jobs_v1(ARRAY[ROW(CAST(:queue AS varchar), CAST(:task AS varchar), "
    "CAST(:priority AS integer), CAST(:lock AS text), CAST(:qlock AS text), CAST(:args AS jsonb), "
    "CAST(:at AS timestamptz))::procrastinate_job_to_defer_v1])"
)


# -- deferring inside the caller's transaction (no procrastinate import needed) -----------------


def _defer(
    session: Session,
    *,
    task: str,
    queue: str,
    args: dict[str, Any],
    lock: str,
    queueing_lock: str | None,
    priority: int = 0,
) -> bool:
    """Insert one job row in the session's transaction; False when one already waits (queueing lock)."""
    try:
        with session.begin_nested():
            session.execute(
                _DEFER,
                {
                    "queue": queue,
                    "task": task,
                    "priority": priority,
                    "lock": lock,
                    "qlock": queueing_lock,
                    "args": json.dumps(args),
                    "at": None,  # run as soon as committed
                },
            )
    except IntegrityError:  # the queueing lock: a job for the same object is already waiting
        return False
    return True


def defer_analyses(session: Session, trace_ids: Sequence[int], *, priority: int = 0) -> None:
    """``priority``: procrastinate fetches higher first (``claims.enqueue_analyses`` sets it per team)."""
    for trace_id in trace_ids:
        _defer(
            session,
            task=ANALYZE,
            queue=QUEUE_ANALYSIS,
            args={"trace_id": int(trace_id)},
            lock=f"trace:{trace_id}",
            queueing_lock=f"trace:{trace_id}",
            priority=priority,
        )


def defer_aggregation(session: Session, run_id: int) -> None:
    _defer(
        session,
        task=AGGREGATE,
        queue=QUEUE_AGGREGATION,
        args={"run_id": int(run_id)},
        lock=f"run:{run_id}",
        # No queueing lock: coalescing at defer time would race with a waiting job that starts
        # before this transaction commits (and skips, seeing this trace still running). One job
        # per finished trace, serialised by the lock; all but the last skip after two cheap
        # queries (traces waiting? inputs digest unchanged?), so reports are read once.
        queueing_lock=None,
        priority=1,
    )


class TransientJobError(Exception):
    """The database stayed unreachable mid-job: the job is retried later, never failed for it."""


def retry_wait_s(settings: Any, tries: int) -> float:
    """How long to wait after the ``tries``-th try (1-based) failed on an unreachable store."""
    return float(min(300.0, settings.analysis_retry_wait_s * 2 ** (tries - 1)))


# Task name -> what runs it, with the worker's runtime first (registered by the domains' job modules).
HANDLERS: dict[str, Callable[..., None]] = {}


@dataclass(frozen=True)
class JobContext:
    """What a claimer of the embedded pool gets: the database, the queue, the store, its identity."""

    db: Any
    queue: Any
    store: Any
    settings: Any
    worker_id: str


# The embedded pool's claimers, asked in order for one job each (True: one ran).
CLAIMERS: list[Callable[[JobContext], bool]] = []
# Run (with the database and the run id) after a trace's analysis is stored by the embedded pool.
TRACE_DONE: list[Callable[[Any, int], None]] = []
# Periodic sweeps (with the database) the pool runs at start and every sweep; they return the ids they requeued.
SWEEPS: list[Callable[[Any], list[int]]] = []


def run_sweeps(db: Any) -> int:
    """Run every registered sweep; how many jobs they put back."""
    return sum(len(sweep(db)) for sweep in SWEEPS)


def handles(task: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register the function a task runs."""

    def register(fn: Callable[..., None]) -> Callable[..., None]:
        HANDLERS[task] = fn
        return fn

    return register
