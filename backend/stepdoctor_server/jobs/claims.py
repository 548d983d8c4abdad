"""The analysis job queue: ``JobQueue`` interface and ``SqlJobQueue`` over the ``traces`` table.

``SqlDeepQueue`` runs the optional HTA analyses (``deep_analyses``) with the same claim code.

A job's state is its trace row: ``pending -> running -> done | failed``. The embedded engine
(SQLite, one host) claims pending rows directly, so an accepted upload *is* an enqueued job. With
procrastinate (PostgreSQL, ``procrastinate_app``) delivery moves to procrastinate's tables, but the job rows are
written by the same transaction (``enqueue_analyses``, ``schedule_aggregation``), and a delivery
claims its trace here (``claim_trace``): completion is guarded by ``claimed_by``, so a job taken
over from a worker presumed dead never stores a second analysis.

Claiming is atomic on both databases:
- PostgreSQL: ``UPDATE ... WHERE id = (SELECT ... FOR UPDATE SKIP LOCKED)``, so concurrent workers
  never block on, nor double-claim, the same row.
- SQLite: pick the oldest pending id, then ``UPDATE ... WHERE id = :id AND status = 'pending'``;
  a rowcount of 0 means another worker won, so try the next one. SQLite serialises writers.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from sqlalchemy import ColumnElement, delete, func, null, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from stepdoctor_server.core.database import Database, defers_jobs
from stepdoctor_server.core.models import Analysis, DeepAnalysis, Trace
from stepdoctor_server.jobs.defer import defer_aggregation, defer_analyses
from stepdoctor_server.jobs.limits import process_alive

# A job claimed more often than this (its worker died each time) is failed, not retried forever.
MAX_ATTEMPTS = 3
REASON_MAX_CHARS = 1000


@dataclass(frozen=True)
class AnalysisResult:
    """What a worker stores for one trace."""

    engine_version: str
    schema_version: int
    primary_kind: str | None
    primary_share: float | None
    report: dict[str, Any]
    duration_ms: int


class JobQueue(Protocol):
    """Analysis jobs keyed by trace id."""

    def enqueue(self, trace_id: int) -> None:
        """(Re)queue a trace for analysis, whatever its state."""

    def claim(self, worker_id: str) -> int | None:
        """Atomically take the oldest pending job; None when there is none."""

    def claim_trace(self, trace_id: int, worker_id: str) -> bool:
        """Take one given trace a job engine delivered; False for a duplicate delivery."""

    def complete(self, trace_id: int, analysis: AnalysisResult, worker_id: str | None = None) -> bool:
        """Store the analysis and mark the job done, if it is still this worker's."""

    def fail(self, trace_id: int, reason: str, worker_id: str | None = None) -> bool:
        """Mark the job failed with a one-line reason shown to users, if it is still this worker's."""

    def requeue_stale(self, older_than: timedelta) -> int:
        """Put back jobs claimed longer ago than ``older_than``; returns how many."""

    def requeue_dead_local(self) -> int:
        """Put back jobs held by worker processes of this host that no longer exist."""

    def requeue_worker(self, worker_id: str) -> int:
        """Put back the jobs held by one worker (the pool saw it die)."""


def make_queue(db: Database) -> JobQueue:
    """The configured queue; the one place a broker-backed implementation would be chosen."""
    return SqlJobQueue(db)


def worker_identity(index: int | str = 0) -> str:
    """``host:pid:index`` — lets a restart tell a dead local worker's claims from live ones."""
    return f"{socket.gethostname()}:{os.getpid()}:{index}"


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _finish_running(
    session: Session, table: Any, row_id: int, *, worker_id: str | None = None, **values: Any
) -> bool:
    """End a job, but only if it is still running (and, given ``worker_id``, still ours).

    A reset to pending meanwhile (reanalyze, force) wins, and the job runs again; a job taken over
    by another worker (this one was presumed dead) keeps that worker's result. Returns whether
    this call ended it, so a second delivery of a job never stores a second analysis.
    """
    where = [table.id == row_id, table.status == "running"]
    if worker_id is not None:
        where.append(table.claimed_by == worker_id)
    result = session.execute(
        update(table)
        .where(*where)
        .values(**values, updated_at=_now())
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount) == 1  # type: ignore[attr-defined]


def _one_line(reason: str) -> str:
    line = " ".join(reason.split())
    return line[: REASON_MAX_CHARS - 3] + "..." if len(line) > REASON_MAX_CHARS else line


JobTable = type[Trace] | type[DeepAnalysis]
# Every table with the job columns (status, attempts, claimed_by, claimed_at): requeues cover all.
JOB_TABLES: tuple[JobTable, ...] = (Trace, DeepAnalysis)


def claim_row(session: Session, table: JobTable, worker_id: str, *, postgres: bool) -> int | None:
    """Atomically move the oldest pending row of ``table`` to running; its id, or None."""
    now = _now()
    values: dict[str, Any] = {
        "status": "running",
        "claimed_by": worker_id,
        "claimed_at": now,
        "updated_at": now,
        "attempts": table.attempts + 1,
    }
    # Fairness (#12): re-analyses (priority 1) wait behind every fresh upload (priority 0), and a
    # team with no job running goes before teams with some, so neither a requeued backlog nor
    # another team's flood of uploads delays a trace by more than the jobs already running.
    order = [table.priority] if table is Trace else []
    oldest = (
        select(table.id)
        .where(table.status == "pending")
        .order_by(*order, table.created_at, table.id)
        .limit(1)
    )
    queries = [oldest]
    if table is Trace:
        busy_teams = select(Trace.team_id).where(Trace.status == "running")
        queries.insert(0, oldest.where(Trace.team_id.not_in(busy_teams)))
    for query in queries:
        claimed = _claim_first(session, table, query, values, postgres=postgres)
        if claimed is not None:
            return claimed
    return None


def _claim_first(
    session: Session, table: JobTable, query: Any, values: dict[str, Any], *, postgres: bool
) -> int | None:
    """Move the row ``query`` selects to running (concurrent claimers skip or retry); its id."""
    if postgres:
        stmt = (
            update(table)
            .where(table.id == query.with_for_update(skip_locked=True).scalar_subquery())
            .values(**values)
            .returning(table.id)
        )
        return session.execute(stmt).scalar_one_or_none()
    for _ in range(8):
        candidate = session.scalar(query)
        if candidate is None:
            return None
        claimed = session.execute(
            update(table)
            .where(table.id == candidate, table.status == "pending")
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        if claimed.rowcount == 1:  # type: ignore[attr-defined]
            return int(candidate)
    return None


class SqlJobQueue:
    """``JobQueue`` over the ``traces`` table (PostgreSQL or SQLite)."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._postgres = db.engine.dialect.name == "postgresql"

    def enqueue(self, trace_id: int) -> None:
        with self.db.session() as session:
            reset_to_pending(session, [trace_id])

    def claim(self, worker_id: str) -> int | None:
        with self.db.session() as session:
            return claim_row(session, Trace, worker_id, postgres=self._postgres)

    def claim_trace(self, trace_id: int, worker_id: str) -> bool:
        """Take one given trace (a job engine delivered it): pending, or running under a worker the
        engine declared dead. False when it is done, failed or gone (a duplicate delivery)."""
        now = _now()
        with self.db.session() as session:
            result = session.execute(
                update(Trace)
                .where(Trace.id == trace_id, Trace.status.in_(("pending", "running")))
                .values(
                    status="running",
                    claimed_by=worker_id,
                    claimed_at=now,
                    updated_at=now,
                    attempts=Trace.attempts + 1,
                )
                .execution_options(synchronize_session=False)
            )
            return int(result.rowcount) == 1  # type: ignore[attr-defined]

    def complete(self, trace_id: int, analysis: AnalysisResult, worker_id: str | None = None) -> bool:
        """Store the analysis and end the job in one transaction; False if the job was not ours."""
        with self.db.session() as session:
            if not _finish_running(
                session, Trace, trace_id, worker_id=worker_id, status="done", status_reason=None
            ):
                return False
            session.execute(delete(Analysis).where(Analysis.trace_id == trace_id))
            session.add(
                Analysis(
                    trace_id=trace_id,
                    engine_version=analysis.engine_version,
                    schema_version=analysis.schema_version,
                    primary_kind=analysis.primary_kind,
                    primary_share=analysis.primary_share,
                    report=analysis.report,
                    duration_ms=analysis.duration_ms,
                )
            )
            schedule_aggregation(session, trace_id)
            return True

    def note(self, trace_id: int, reason: str, worker_id: str | None = None) -> bool:
        """Show ``reason`` on a trace this worker still runs (it waits to try again)."""
        with self.db.session() as session:
            result = session.execute(
                update(Trace)
                .where(Trace.id == trace_id, Trace.status == "running", Trace.claimed_by == worker_id)
                .values(status_reason=_one_line(reason), updated_at=_now())
                .execution_options(synchronize_session=False)
            )
            return int(result.rowcount) == 1  # type: ignore[attr-defined]

    def release(self, trace_id: int, reason: str, worker_id: str | None = None) -> bool:
        """Back to pending with ``reason`` shown, the claim undone (this try did not count as a
        worker's death): the job engine delivers it again later (an unreachable store)."""
        with self.db.session() as session:
            return _finish_running(
                session,
                Trace,
                trace_id,
                worker_id=worker_id,
                status="pending",
                status_reason=_one_line(reason),
                claimed_by=None,
                claimed_at=None,
                attempts=Trace.attempts - 1,
            )

    def fail(self, trace_id: int, reason: str, worker_id: str | None = None) -> bool:
        with self.db.session() as session:
            ended = _finish_running(
                session,
                Trace,
                trace_id,
                worker_id=worker_id,
                status="failed",
                status_reason=_one_line(reason),
            )
            if ended:
                schedule_aggregation(session, trace_id)
            return ended

    def requeue_stale(self, older_than: timedelta) -> int:
        """Requeue running jobs claimed longer ago than ``older_than`` (their worker is presumed dead)."""
        cutoff = _now() - older_than
        return self._requeue_running(lambda table: table.claimed_at < cutoff)

    def requeue_dead_local(self) -> int:
        """Requeue jobs claimed by worker processes of this host that no longer exist.

        Run at pool start: a killed worker leaves its job ``running``; a live worker on another
        host (``stepdoctor worker`` elsewhere) keeps its claims.
        """
        host = socket.gethostname()
        total = 0
        with self.db.session() as session:
            for table in JOB_TABLES:
                rows = session.execute(
                    select(table.id, table.claimed_by).where(table.status == "running")
                ).all()
                total += requeue_or_give_up(
                    session, table, [jid for jid, owner in rows if _is_dead_local(owner, host)]
                )
        return total

    def requeue_worker(self, worker_id: str) -> int:
        """Requeue the jobs held by one worker (its process just died)."""
        return self._requeue_running(lambda table: table.claimed_by == worker_id)

    def _requeue_running(self, which: Callable[[JobTable], ColumnElement[bool]]) -> int:
        """Requeue (or give up on) the running jobs of every job table that match ``which``."""
        with self.db.session() as session:
            return sum(
                requeue_or_give_up(
                    session,
                    table,
                    session.scalars(select(table.id).where(table.status == "running", which(table))).all(),
                )
                for table in JOB_TABLES
            )


class SqlDeepQueue:
    """Deep-analysis jobs (``deep_analyses``): claimed, requeued and failed like traces.

    Workers turn to this queue only when the trace queue is empty: deep analyses are optional
    extras someone asked for, and must not delay the diagnoses every upload waits on.
    """

    def __init__(self, db: Database) -> None:
        self.db = db
        self._postgres = db.engine.dialect.name == "postgresql"

    def claim(self, worker_id: str) -> int | None:
        with self.db.session() as session:
            return claim_row(session, DeepAnalysis, worker_id, postgres=self._postgres)

    def complete(self, job_id: int, result: dict[str, Any]) -> None:
        """Store the result; a job reset meanwhile (``force``) stays pending and runs again."""
        with self.db.session() as session:
            _finish_running(session, DeepAnalysis, job_id, status="done", status_reason=None, result=result)

    def fail(self, job_id: int, reason: str) -> None:
        with self.db.session() as session:
            _finish_running(
                session, DeepAnalysis, job_id, status="failed", status_reason=_one_line(reason), result=null()
            )


def deep_params_key(params: dict[str, Any]) -> str:
    """Canonical JSON of a deep job's parameters: equal requests share one row."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


def request_deep_analysis(
    session: Session, trace_id: int, kind: str, params: dict[str, Any], *, force: bool = False
) -> tuple[DeepAnalysis, bool]:
    """Find or queue the (trace, kind, params) job; returns it and whether this call queued it.

    A pending, running or done job is returned as is (repeating a request is free); a failed one,
    or any with ``force``, goes back to pending with fresh attempts.
    """
    key = deep_params_key(params)
    query = select(DeepAnalysis).where(
        DeepAnalysis.trace_id == trace_id, DeepAnalysis.kind == kind, DeepAnalysis.params_key == key
    )
    job = session.scalar(query)
    if job is None:
        try:
            with session.begin_nested():
                job = DeepAnalysis(trace_id=trace_id, kind=kind, params=params, params_key=key, attempts=0)
                session.add(job)
                session.flush()
            return job, True
        except IntegrityError:  # the same request, concurrently
            job = session.scalars(query).one()
    if job.status != "failed" and not force:
        return job, False
    session.execute(
        update(DeepAnalysis)
        .where(DeepAnalysis.id == job.id)
        .values(
            status="pending",
            status_reason=None,
            result=null(),
            claimed_by=None,
            claimed_at=None,
            attempts=0,
            updated_at=_now(),
        )
        .execution_options(synchronize_session=False)
    )
    session.refresh(job)
    return job, True


def _is_dead_local(owner: str | None, host: str) -> bool:
    if not owner:
        return True
    parts = owner.rsplit(":", 2)
    if len(parts) != 3 or parts[0] != host:
        return False
    try:
        pid = int(parts[1])
    except ValueError:
        return True
    return not process_alive(pid)


def requeue_or_give_up(session: Session, table: JobTable, ids: Sequence[int]) -> int:
    """Back to pending, unless the job already killed MAX_ATTEMPTS workers: then it fails."""
    if not ids:
        return 0
    now = _now()
    session.execute(
        update(table)
        .where(table.id.in_(list(ids)), table.status == "running", table.attempts >= MAX_ATTEMPTS)
        .values(
            status="failed",
            status_reason=f"internal error: the analysis worker died {MAX_ATTEMPTS} times on this job",
            updated_at=now,
        )
        .execution_options(synchronize_session=False)
    )
    result = session.execute(
        update(table)
        .where(table.id.in_(list(ids)), table.status == "running")
        .values(status="pending", claimed_by=None, claimed_at=None, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


# procrastinate fetches the highest priority first (ties: oldest first). A fresh upload's priority
# is minus its team's backlog of pending traces, so each team's k-th waiting job ranks with the
# other teams' k-th: a flood from one team delays another team's next upload by at most one job
# per team ahead of it, never by the whole backlog (#12). Re-analyses rank below every upload.
MAX_BACKLOG_RANK = 10_000
REANALYSIS_PRIORITY = -(MAX_BACKLOG_RANK + 1)


def upload_priority(session: Session, trace_id: int) -> int:
    """Minus the number of other pending traces of this trace's team (capped)."""
    team = select(Trace.team_id).where(Trace.id == trace_id).scalar_subquery()
    backlog = session.scalar(
        select(func.count())
        .select_from(Trace)
        .where(Trace.team_id == team, Trace.status == "pending", Trace.id != trace_id)
    )
    return -min(int(backlog or 0), MAX_BACKLOG_RANK)


def enqueue_analyses(session: Session, trace_ids: Sequence[int], *, reanalysis: bool = False) -> None:
    """Hand pending traces to the job engine inside the caller's transaction.

    With procrastinate the job rows are inserted by the same commit as the trace rows, so an
    accepted upload is never without its job and a rolled-back one never has one. The embedded
    pool needs nothing: its workers claim pending rows of ``traces`` directly (``claim_row``
    applies the same fairness).
    """
    if trace_ids and defers_jobs(session):
        for trace_id in trace_ids:
            priority = REANALYSIS_PRIORITY if reanalysis else upload_priority(session, trace_id)
            defer_analyses(session, [trace_id], priority=priority)


def schedule_aggregation(session: Session, trace_id: int) -> None:
    """With procrastinate, queue the run's aggregation job in this transaction (coalesced per run)."""
    if defers_jobs(session):
        run_id = session.scalar(select(Trace.run_id).where(Trace.id == trace_id))
        if run_id is not None:
            defer_aggregation(session, run_id)


def reset_to_pending(session: Session, trace_ids: Sequence[int]) -> int:
    """Queue traces (again) for analysis; attempts restart so a retried trace gets full retries."""
    if not trace_ids:
        return 0
    enqueue_analyses(session, trace_ids, reanalysis=True)  # behind every fresh upload (#12)
    result = session.execute(
        update(Trace)
        .where(Trace.id.in_(list(trace_ids)))
        .values(
            status="pending",
            status_reason=None,
            claimed_by=None,
            claimed_at=None,
            attempts=0,
            priority=1,  # behind fresh uploads in the claim order (see claim_row)
            updated_at=_now(),
        )
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]
