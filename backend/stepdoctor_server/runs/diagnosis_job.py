"""The run-diagnosis job: a run's verdict refreshed as its traces finish, and the sweep that redoes
what another engine wrote (stale reports and diagnoses, ``traces.reports.is_stale``).

Registered with the job engine (``jobs.defer``): ``AGGREGATE`` for procrastinate, a ``TRACE_DONE``
hook for the embedded pool, and ``requeue_outdated`` and ``recheck_series_diagnoses`` (a run's step
series, one of the verdict's inputs, grew) as sweeps.

A run's verdict is folded from its traces' compact summaries (``rank_summaries``, one per analysis,
made once from the report: ``store_summaries``), never from every report. Each process keeps the
aggregates of the runs it refreshed last (``_HELD``) and reads only the summaries of analyses it has
not folded in yet; a re-analysed trace (a new analysis id) replaces its old summary, a deleted one
leaves. All of it runs under the run's row lock, one writer per run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import msgspec
from sqlalchemy import case, func, select, update
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session

from stepdoctor_analysis import ENGINE_VERSION, SCHEMA_VERSION
from stepdoctor_analysis.run.aggregate import RunAggregate
from stepdoctor_analysis.run.trace_summary import TraceSummary, decode, encode
from stepdoctor_analysis.run.verdict import DIAGNOSIS_VERSION
from stepdoctor_server.core.database import Database
from stepdoctor_server.core.models import Analysis, Run, SeriesStream, Trace, TraceSummaryRecord
from stepdoctor_server.jobs.claims import _now, reset_to_pending
from stepdoctor_server.jobs.defer import AGGREGATE, SWEEPS, TRACE_DONE, handles
from stepdoctor_server.jobs.pool import _observe, retry_db
from stepdoctor_server.runs.diagnosis import StoredTrace, read_verdict, summary_of_stored
from stepdoctor_server.runs.regressions import LIVE_RECHECK, refresh_regression, series_chunks
from stepdoctor_server.runs.series import run_timeline_of
from stepdoctor_server.traces.reports import is_stale

log = logging.getLogger("stepdoctor.worker")
DIAGNOSIS_MIN_INTERVAL = timedelta(seconds=5)
HELD_RUNS = 8  # runs whose aggregate a process keeps between refreshes
BATCH = 256  # reports (or summaries) read at a time


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

    Each refresh judges every rank and stores a verdict that lists them, so redoing it after each
    of a 1,000-trace run's jobs would be quadratic. While other traces of the run are still queued,
    refresh at most every ``min_interval``; the run's last job always refreshes.
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
    no lost update. Without ``force`` nothing is re-read when the inputs (analysis ids, trace
    states and the step series' chunk count) are the ones the stored diagnosis was built from; then
    None is returned. The verdict is folded from the traces' summaries (module docstring), not their
    reports, with the run's step-series memory (exact) as ``stepdoctor analyze RUN_DIR`` passes it:
    a leak the series shows over the whole run is the server's finding too.
    """
    _lock_run(session, run_id)
    basis = _diagnosis_basis(session, run_id)
    if not force and session.scalar(select(Run.diagnosis_basis).where(Run.id == run_id)) == basis:
        return None
    store_summaries(session, run_id)
    aggregate, outdated = _run_aggregate(session, run_id)
    counts = dict(
        session.execute(
            select(Trace.status, func.count()).where(Trace.run_id == run_id).group_by(Trace.status)
        ).all()
    )
    timeline = run_timeline_of(session, run_id, fresh_within_s=0)
    verdict = aggregate.verdict(
        failed=int(counts.get("failed", 0)),
        pending=int(counts.get("pending", 0)) + int(counts.get("running", 0)),
        outdated=outdated,
        series=timeline.memory if timeline is not None else None,
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
    _refresh_regression(session, run_id)
    return diagnosis


def _refresh_regression(session: Session, run_id: int) -> None:
    """The run against its project's baseline (``regressions``; may queue its webhook), in a
    savepoint: a failure there is logged and never costs the diagnosis just written."""
    try:
        with session.begin_nested():
            refresh_regression(session, run_id)
    except (OperationalError, InterfaceError):  # the database is away: the job retries as a whole
        raise
    except Exception:
        log.exception("run %s: regression check failed", run_id)


def _lock_run(session: Session, run_id: int) -> None:
    """The run's row lock (``FOR UPDATE`` on PostgreSQL; SQLite serialises writers): one writer of
    its diagnosis and summaries at a time."""
    session.execute(select(Run.id).where(Run.id == run_id).with_for_update())


def store_summaries(session: Session, run_id: int) -> int:
    """Give each analysis of the run without a stored summary one, made from its report (once per
    analysis: reports of an older engine, or analyses stored before summaries existed). Reports are
    read ``BATCH`` at a time. Returns how many were made."""
    missing = session.scalars(
        select(Analysis.id)
        .join(Trace, Trace.id == Analysis.trace_id)
        .outerjoin(TraceSummaryRecord, TraceSummaryRecord.analysis_id == Analysis.id)
        .where(Trace.run_id == run_id, TraceSummaryRecord.analysis_id.is_(None))
        .order_by(Analysis.id)
    ).all()
    for start in range(0, len(missing), BATCH):
        rows = session.execute(
            select(Analysis.id, Trace.id, Trace.rank, Trace.window_index, Trace.meta, Analysis.report)
            .join(Trace, Trace.id == Analysis.trace_id)
            .where(Analysis.id.in_(missing[start : start + BATCH]))
        ).all()
        for analysis_id, *stored in rows:
            summary = summary_of_stored(StoredTrace(*stored))
            session.add(
                TraceSummaryRecord(
                    analysis_id=analysis_id,
                    trace_id=stored[0],
                    run_id=run_id,
                    summary=encode(summary) if summary is not None else None,
                )
            )
        session.flush()
    return len(missing)


@dataclass
class _Held:
    """A run's aggregate and, per trace, the summary row folded into it (analysis id, row time)."""

    aggregate: RunAggregate = field(default_factory=RunAggregate)
    stamps: dict[int, tuple[int, datetime]] = field(default_factory=dict)


_HELD: OrderedDict[tuple[str, int], _Held] = OrderedDict()  # (database, run id) -> its aggregate
_HELD_LOCK = threading.Lock()


def _run_aggregate(session: Session, run_id: int) -> tuple[RunAggregate, int]:
    """The run's aggregate brought up to date with its stored summaries, and how many of its
    analyses have none (their report does not decode: ``outdated``). Only summaries not folded in
    before are read; the process keeps the last ``HELD_RUNS`` runs' aggregates."""
    key = (session.get_bind().engine.url.render_as_string(hide_password=True), run_id)
    now: dict[int, tuple[int, datetime]] = {}
    outdated = 0
    for trace_id, analysis_id, created_at, empty in session.execute(
        select(
            TraceSummaryRecord.trace_id,
            TraceSummaryRecord.analysis_id,
            TraceSummaryRecord.created_at,
            TraceSummaryRecord.summary.is_(None),
        )
        .join(Analysis, Analysis.id == TraceSummaryRecord.analysis_id)  # only current analyses
        .where(TraceSummaryRecord.run_id == run_id)
    ):
        if empty:
            outdated += 1
        else:
            now[trace_id] = (analysis_id, created_at)
    with _HELD_LOCK:
        held = _HELD.pop(key, None) or _Held()
    for trace_id in [t for t, stamp in held.stamps.items() if now.get(t) != stamp]:
        held.aggregate.remove(trace_id)
        del held.stamps[trace_id]
    wanted = sorted(aid for t, (aid, _) in now.items() if t not in held.stamps)
    for start in range(0, len(wanted), BATCH):
        rows = session.execute(
            select(
                TraceSummaryRecord.trace_id, TraceSummaryRecord.analysis_id, TraceSummaryRecord.summary
            ).where(TraceSummaryRecord.analysis_id.in_(wanted[start : start + BATCH]))
        ).all()
        for trace_id, analysis_id, data in rows:
            summary = decode(data) if data is not None else None
            if summary is None:  # another summary layout: made again from the report
                summary = _remake_summary(session, analysis_id)
            if summary is None:
                outdated += 1
                continue
            held.aggregate.add(summary)
            held.stamps[trace_id] = now[trace_id]
    with _HELD_LOCK:
        _HELD[key] = held
        while len(_HELD) > HELD_RUNS:
            _HELD.popitem(last=False)
    return held.aggregate, outdated


def _remake_summary(session: Session, analysis_id: int) -> TraceSummary | None:
    row = session.execute(
        select(Trace.id, Trace.rank, Trace.window_index, Trace.meta, Analysis.report)
        .join(Trace, Trace.id == Analysis.trace_id)
        .where(Analysis.id == analysis_id)
    ).one()
    summary = summary_of_stored(StoredTrace(*row))
    session.execute(
        update(TraceSummaryRecord)
        .where(TraceSummaryRecord.analysis_id == analysis_id)
        .values(summary=encode(summary) if summary is not None else None)
    )
    return summary


def _diagnosis_basis(session: Session, run_id: int) -> str:
    """A digest of what a run diagnosis depends on: each trace's state and analysis id (no reports),
    and how many step-series chunks the run has (chunks are only added: a new one is a new basis)."""

    rows = session.execute(
        select(Trace.id, Trace.status, Analysis.id)
        .outerjoin(Analysis, Analysis.trace_id == Trace.id)
        .where(Trace.run_id == run_id)
        .order_by(Trace.id)
    ).all()
    basis = [[list(r) for r in rows], series_chunks(session, run_id)]
    return hashlib.sha256(json.dumps(basis).encode()).hexdigest()


def recheck_series_diagnoses(session: Session, *, within: timedelta = timedelta(days=1)) -> list[int]:
    """Redo the diagnosis of analysed runs whose step series got chunks since it was computed (the
    verdict reads the series' memory: a leak over the whole run). The workers' sweep, on both job
    engines; only runs heard from within ``within`` are looked at, none with a trace still waiting
    (its last trace refreshes it), and a run whose processes have not all ended at most every
    ``LIVE_RECHECK`` (each redo reads its whole series once). Returns the runs redone."""
    open_streams = func.sum(case((SeriesStream.final.is_(False), 1), else_=0))
    analysed = select(Trace.run_id).join(Analysis, Analysis.trace_id == Trace.id)
    waiting = select(Trace.run_id).where(Trace.status.in_(("pending", "running")))
    rows = session.execute(
        select(SeriesStream.run_id, open_streams)
        .where(
            SeriesStream.run_id.in_(
                select(SeriesStream.run_id).where(SeriesStream.heartbeat_at >= _now() - within)
            ),
            SeriesStream.run_id.in_(analysed),
            SeriesStream.run_id.not_in(waiting),
        )
        .group_by(SeriesStream.run_id)
    ).all()
    soon = (_now() - LIVE_RECHECK).isoformat()
    redone = []
    for run_id, still_open in rows:
        computed = (session.scalar(select(Run.diagnosis).where(Run.id == run_id)) or {}).get("computed_at")
        if still_open and isinstance(computed, str) and computed > soon:
            continue  # live: its diagnosis is at most LIVE_RECHECK old
        if refresh_run_diagnosis(session, run_id, force=False) is not None:
            redone.append(int(run_id))
    return redone


def recheck_series_diagnoses_now(db: Database) -> list[int]:
    """``recheck_series_diagnoses`` in its own transaction (the sweep's body)."""
    with db.session() as session:
        return recheck_series_diagnoses(session)


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
            if waiting:  # not the run's last trace: only its summaries, made while the report is fresh
                _lock_run(session, run_id)
                store_summaries(session, run_id)
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
                _lock_run(session, run_id)
                store_summaries(session, run_id)  # the finished trace's summary now, the verdict later
                return
            refresh_run_diagnosis(session, run_id, force=False)
    except Exception:  # the per-trace result is stored; the aggregate is redone on the next job
        log.exception("run %s: diagnosis refresh failed", run_id)


TRACE_DONE.append(_refresh_run)
SWEEPS.append(requeue_outdated_now)
SWEEPS.append(recheck_series_diagnoses_now)
