"""The run-diagnosis job: a run's verdict refreshed as its traces finish, and the sweep that redoes
what another engine wrote (stale reports and diagnoses, ``traces.reports.is_stale``).

Registered with the job engine (``jobs.defer``): ``AGGREGATE`` for procrastinate, a ``TRACE_DONE``
hook for the embedded pool, and ``requeue_outdated`` as a sweep.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from datetime import datetime, timedelta
from typing import Any

import msgspec
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from stepdoctor_analysis import ENGINE_VERSION, SCHEMA_VERSION
from stepdoctor_analysis.run_verdict import DIAGNOSIS_VERSION
from stepdoctor_server.core.database import Database
from stepdoctor_server.core.models import Analysis, Run, Trace
from stepdoctor_server.jobs.claims import _now, reset_to_pending
from stepdoctor_server.jobs.defer import AGGREGATE, SWEEPS, TRACE_DONE, handles
from stepdoctor_server.jobs.pool import _observe, retry_db
from stepdoctor_server.runs.diagnosis import StoredTrace, aggregate_run, read_verdict
from stepdoctor_server.traces.reports import is_stale

log = logging.getLogger("stepdoctor.worker")
DIAGNOSIS_MIN_INTERVAL = timedelta(seconds=5)


def requeue_outdated(session: Session) -> list[int]:
    """The re-analysis job for stale reports (``reports.is_stale``): finished traces whose analysis
    another engine or schema wrote go back to pending (behind fresh uploads), and runs whose stored
    diagnosis is another layout are re-aggregated. Run by the workers' sweep, never by a GET."""
    rows = session.execute(
        select(Trace.id, Analysis.engine_version, Analysis.schema_version)
        .join(Analysis, Analysis.trace_id == Trace.id)
        .where(Trace.status.in_(("done", "failed")))
        .where((Analysis.engine_version != ENGINE_VERSION) | (Analysis.schema_version != SCHEMA_VERSION))
    ).all()
    ids = [r.id for r in rows if is_stale(r.engine_version, r.schema_version)]
    reset_to_pending(session, ids)
    for run_id, diagnosis in session.execute(select(Run.id, Run.diagnosis).where(Run.diagnosis.is_not(None))):
        if diagnosis_stale(diagnosis):
            refresh_run_diagnosis(session, run_id)
    return ids


def diagnosis_stale(stored: dict[str, Any] | None) -> bool:
    """A stored run diagnosis of another layout (``run_verdict.DIAGNOSIS_VERSION``) or engine."""
    verdict = read_verdict(stored)
    return (
        verdict is None
        or verdict.diagnosis_version != DIAGNOSIS_VERSION
        or (verdict.engine_version is not None and verdict.engine_version != ENGINE_VERSION)
    )


def diagnosis_due(session: Session, run_id: int, *, min_interval: timedelta = DIAGNOSIS_MIN_INTERVAL) -> bool:
    """Whether to re-aggregate the run now.

    Aggregating reads every report of the run, so redoing it after each of a 512-trace run's jobs
    would be quadratic. While other traces of the run are still queued, refresh at most every
    ``min_interval``; the run's last job always refreshes.
    """
    waiting = session.scalar(
        select(func.count(Trace.id)).where(Trace.run_id == run_id, Trace.status.in_(("pending", "running")))
    )
    if not waiting:
        return True
    diagnosis = session.scalar(select(Run.diagnosis).where(Run.id == run_id))
    computed = (diagnosis or {}).get("computed_at")
    if not isinstance(computed, str):
        return True
    try:
        last = datetime.fromisoformat(computed)
    except ValueError:
        return True
    return _now() - last >= min_interval


def refresh_run_diagnosis(session: Session, run_id: int, *, force: bool = True) -> dict[str, Any] | None:
    """Recompute and store the run-level diagnosis from every analysed trace of the run.

    The run row is locked first (``FOR UPDATE`` on PostgreSQL; SQLite serialises writers), so two
    aggregations of one run never interleave and the last one to commit saw every earlier commit:
    no lost update. Without ``force`` nothing is re-read when the inputs (analysis ids and trace
    states) are the ones the stored diagnosis was built from; then None is returned.
    """
    session.execute(select(Run.id).where(Run.id == run_id).with_for_update())
    basis = _diagnosis_basis(session, run_id)
    if not force and session.scalar(select(Run.diagnosis_basis).where(Run.id == run_id)) == basis:
        return None
    rows = session.execute(
        select(Trace.id, Trace.rank, Trace.window_index, Trace.meta, Analysis.report)
        .join(Analysis, Analysis.trace_id == Trace.id)
        .where(Trace.run_id == run_id)
        .order_by(Trace.id)
    ).all()
    counts = dict(
        session.execute(
            select(Trace.status, func.count()).where(Trace.run_id == run_id).group_by(Trace.status)
        ).all()
    )
    verdict = aggregate_run(
        [StoredTrace(*row) for row in rows],
        failed=int(counts.get("failed", 0)),
        pending=int(counts.get("pending", 0)) + int(counts.get("running", 0)),
    )
    verdict.computed_at = _now().isoformat()
    diagnosis: dict[str, Any] = msgspec.to_builtins(verdict)
    engine_version = verdict.engine_version
    session.execute(
        update(Run)
        .where(Run.id == run_id)
        .values(
            diagnosis=diagnosis,
            diagnosis_basis=basis,
            aggregations=Run.aggregations + 1,
            primary_kind=verdict.primary.kind if verdict.primary else None,
            diagnosis_engine_version=engine_version if isinstance(engine_version, str) else None,
            updated_at=_now(),
        )
        .execution_options(synchronize_session=False)
    )
    return diagnosis


def _diagnosis_basis(session: Session, run_id: int) -> str:
    """A digest of what a run diagnosis depends on: each trace's state and analysis id (no reports)."""

    rows = session.execute(
        select(Trace.id, Trace.status, Analysis.id)
        .outerjoin(Analysis, Analysis.trace_id == Trace.id)
        .where(Trace.run_id == run_id)
        .order_by(Trace.id)
    ).all()
    return hashlib.sha256(json.dumps([list(r) for r in rows]).encode()).hexdigest()


def requeue_outdated_now(db: Database) -> list[int]:
    """``requeue_outdated`` in its own transaction (the sweep's body; tests call it directly)."""
    with db.session() as session:
        return requeue_outdated(session)


@handles(AGGREGATE)
def aggregate_when_finished(runtime: Any, run_id: int) -> None:
    """Body of procrastinate's ``aggregate_run`` job: aggregate once no trace of the run waits.

    The transaction that ends the run's last trace queues the final aggregation, so skipping
    while traces wait loses nothing; the inputs digest skips a repeat with nothing new.
    """
    started = time.perf_counter()

    def aggregate() -> bool:
        with runtime.db.session() as session:
            waiting = session.scalar(
                select(func.count(Trace.id)).where(
                    Trace.run_id == run_id, Trace.status.in_(("pending", "running"))
                )
            )
            if waiting:
                return False
            return refresh_run_diagnosis(session, run_id, force=False) is not None

    done = retry_db(aggregate, what=f"run {run_id} aggregation")
    if done:
        log.info("run %s: diagnosis aggregated", run_id)
        _observe(runtime.metrics, "aggregate", "done", started)


def _refresh_run(db: Database, run_id: int) -> None:
    try:
        with db.session() as session:
            if not diagnosis_due(session, run_id):
                return
            refresh_run_diagnosis(session, run_id, force=False)
    except Exception:  # the per-trace result is stored; the aggregate is redone on the next job
        log.exception("run %s: diagnosis refresh failed", run_id)


TRACE_DONE.append(_refresh_run)
SWEEPS.append(requeue_outdated_now)
