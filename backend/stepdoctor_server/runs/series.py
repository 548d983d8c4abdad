"""A run's step series on the server: chunks stored as the agent wrote them, the run timeline over
them, and whether the run is live, finished or stopped.

* :func:`store_chunk` validates one chunk with the engine's own reader
  (``stepdoctor_analysis.run.timeline.validate_chunk``), refuses one that overlaps a stored chunk
  of the same process, and stores the bytes unchanged (~4 bytes a step), once: a resent chunk is a
  replay. Chunks live in the database, not the trace store: they are small (10,000 steps in ~40 KB),
  go in with their row in one transaction (nothing half kept), and a run's timeline reads them in
  one query.
* :func:`run_timeline_of` is the engine's ``run_timeline`` over the stored chunks (the same
  function ``stepdoctor analyze RUN_DIR`` runs over the spool), kept per run while no chunk
  arrived: at 10 million steps it takes seconds, its kept ``to_dict()`` milliseconds. GETs only
  read it; the :func:`refresh_run_timelines` sweep (and writing jobs) keep it.
* :func:`liveness_of` is the one owner of a run's liveness, from the heartbeats kept per process
  (``SeriesStream``): ``live`` (a heartbeat within ``stale_after_s``, not every process exited
  cleanly), ``finished`` (every rank's latest process wrote its exit chunk) or ``stopped`` (no
  heartbeat for ``stale_after_s`` and no clean exit). A run without a series has no liveness (None).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

import msgspec
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from stepdoctor_analysis import ENGINE_VERSION
from stepdoctor_analysis.run.timeline import Chunk, RunTimeline, SeriesError, run_timeline, validate_chunk
from stepdoctor_server.core.database import READ_ONLY, Database, get_or_create, settings_of
from stepdoctor_server.core.errors import ApiError
from stepdoctor_server.core.models import Run, RunTimelineCache, SeriesChunk, SeriesStream, utcnow
from stepdoctor_server.jobs.defer import SWEEPS

logger = logging.getLogger(__name__)
Liveness = Literal["live", "finished", "stopped"]
#: No heartbeat for this long (and no clean exit) and a run is ``stopped`` (``STEPDOCTOR_SERIES_STALE_AFTER_S``).
STALE_AFTER_S = 300.0


# --- liveness -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamBeat:
    """What liveness needs of one agent process: its rank, latest heartbeat and clean exit."""

    rank: int | None
    heartbeat_at: datetime
    final: bool
    clean: bool = True  # the final chunk says the loop ended without an exception


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


def liveness_rule(
    streams: Iterable[StreamBeat], *, now: datetime | None = None, stale_after_s: float = STALE_AFTER_S
) -> Liveness | None:
    """The rule, over a run's processes: per rank the process heard from last decides (a restart
    replaces a killed one); the run is finished when each of those exited cleanly (its final chunk
    says the loop did not raise), live while one still running is heard from within
    ``stale_after_s``, else stopped (killed, crashed, lost). None without any process."""
    latest: dict[int | None, StreamBeat] = {}
    for beat in streams:
        known = latest.get(beat.rank)
        if known is None or _utc(beat.heartbeat_at) >= _utc(known.heartbeat_at):
            latest[beat.rank] = beat
    if not latest:
        return None
    running = [beat for beat in latest.values() if not beat.final]
    if not running:
        return "finished" if all(beat.clean for beat in latest.values()) else "stopped"
    now = now or datetime.now(timezone.utc)
    newest = max(_utc(beat.heartbeat_at) for beat in running)
    return "live" if (now - newest).total_seconds() < stale_after_s else "stopped"


def liveness_of_runs(
    session: Session,
    run_ids: Iterable[int],
    *,
    now: datetime | None = None,
    stale_after_s: float | None = None,
) -> dict[int, Liveness | None]:
    """:func:`liveness_rule` for several runs in one query (the run lists); None for runs without a
    series. ``stale_after_s`` defaults to the app's ``series_stale_after_s`` setting."""
    if stale_after_s is None:
        stale_after_s = settings_of(session).series_stale_after_s
    ids = list(dict.fromkeys(run_ids))
    beats: dict[int, list[StreamBeat]] = {run_id: [] for run_id in ids}
    if ids:
        rows = session.execute(
            select(
                SeriesStream.run_id,
                SeriesStream.rank,
                SeriesStream.heartbeat_at,
                SeriesStream.final,
                SeriesStream.clean_exit,
            ).where(SeriesStream.run_id.in_(ids))
        )
        for run_id, rank, heartbeat_at, final, clean in rows:
            beats[run_id].append(StreamBeat(rank, heartbeat_at, bool(final), bool(clean)))
    return {
        run_id: liveness_rule(found, now=now, stale_after_s=stale_after_s) for run_id, found in beats.items()
    }


def liveness_of(
    session: Session, run_id: int, *, now: datetime | None = None, stale_after_s: float | None = None
) -> Liveness | None:
    """``"live" | "finished" | "stopped"``, or None when the run has no step series (the threshold:
    the app's ``series_stale_after_s``, 5 minutes unless configured)."""
    return liveness_of_runs(session, [run_id], now=now, stale_after_s=stale_after_s)[run_id]


# --- the run timeline ---------------------------------------------------------------------------


def _basis(session: Session, run_id: int) -> tuple[str, int]:
    """(digest of the chunk set, chunk count): chunks are only ever added, so count and newest id
    name the set."""
    count, newest = session.execute(
        select(func.count(SeriesChunk.id), func.max(SeriesChunk.id))
        .join(SeriesStream, SeriesStream.id == SeriesChunk.stream_id)
        .where(SeriesStream.run_id == run_id)
    ).one()
    return f"{int(count)}:{int(newest or 0)}", int(count)


def run_timeline_of(session: Session, run_id: int, *, fresh_within_s: float = 0.0) -> RunTimeline | None:
    """The engine's :class:`RunTimeline` over the run's stored chunks (in step order), or None when
    the run has no step series (or only chunks without steps).

    The last result is kept per run (``run_timelines``) and reused while no chunk arrived. With
    ``fresh_within_s`` (the run page and API: ``run_timeline_refresh_s``) a kept result is shown
    while chunks keep arriving (a live 10-million-step run's timeline takes ~10 s; no viewer waits
    for it); :func:`refresh_run_timelines` (a sweep) redoes it at most that often. ``check`` and
    regressions pass 0: exact, computed here when needed. A read (a GET) only reads: what it
    computes is not kept; a writing unit of work (a job) keeps it in its own transaction.
    """
    basis, count = _basis(session, run_id)
    if count == 0:
        return None
    cached = session.get(RunTimelineCache, run_id)
    usable = cached is not None and cached.engine_version == ENGINE_VERSION
    if usable and cached is not None and (cached.basis == basis or fresh_within_s > 0):
        return msgspec.convert(cached.timeline, RunTimeline)
    timeline = _compute(session, run_id)
    if timeline is not None and not _reads_only(session):
        try:
            with session.begin_nested():
                _upsert(session, run_id, basis, timeline)
        except IntegrityError:  # kept meanwhile by another unit of work: theirs is as good
            pass
    return timeline


def _reads_only(session: Session) -> bool:
    """A GET's session (``Database.session(read_only=True)``): it never writes (issue #21)."""
    return bool(session.get_bind().get_execution_options().get(READ_ONLY))


def _compute(session: Session, run_id: int) -> RunTimeline | None:
    chunks = session.scalars(
        select(SeriesChunk.data)
        .join(SeriesStream, SeriesStream.id == SeriesChunk.stream_id)
        .where(SeriesStream.run_id == run_id)
        .order_by(SeriesStream.id, SeriesChunk.seq)
    )
    try:
        return run_timeline(bytes(data) for data in chunks)
    except SeriesError:  # only chunks without steps (a process that exited before its first step)
        return None


def _upsert(session: Session, run_id: int, basis: str, timeline: RunTimeline) -> None:
    cached = session.get(RunTimelineCache, run_id)
    if cached is None:
        cached = RunTimelineCache(run_id=run_id)
        session.add(cached)
    cached.basis, cached.engine_version = basis, ENGINE_VERSION
    cached.timeline, cached.updated_at = timeline.to_dict(), utcnow()
    session.flush()


def _basis_count(basis: str) -> int:
    return int(basis.partition(":")[0] or 0)


#: A sweep redoes at most this many runs (the most recently heard from first), and starts no other
#: once it has worked this long: the embedded pool's supervisor runs it (and at start, before its
#: workers); the rest wait for the next sweep.
SWEEP_RUNS = 16
SWEEP_BUDGET_S = 5.0


def stale_run_timelines(session: Session, *, refresh_s: float) -> list[int]:
    """Runs whose kept timeline is missing, of another engine, or behind their chunks and older
    than ``refresh_s``: most recently heard from first. Chunks are only added, so a run whose
    streams count the kept basis's chunks is current (one query over the streams, not the chunks)."""
    rows = session.execute(
        select(
            SeriesStream.run_id,
            func.sum(SeriesStream.chunks),
            func.max(SeriesStream.heartbeat_at),
            RunTimelineCache.basis,
            RunTimelineCache.engine_version,
            RunTimelineCache.updated_at,
        )
        .outerjoin(RunTimelineCache, RunTimelineCache.run_id == SeriesStream.run_id)
        .group_by(
            SeriesStream.run_id,
            RunTimelineCache.basis,
            RunTimelineCache.engine_version,
            RunTimelineCache.updated_at,
        )
    ).all()
    now = utcnow()
    due: list[tuple[datetime, int]] = []
    for run_id, chunks, heard, basis, engine, updated in rows:
        if not chunks:
            continue
        if basis is not None and engine == ENGINE_VERSION:
            if _basis_count(basis) == int(chunks):
                continue
            if (now - _utc(updated)).total_seconds() < refresh_s:
                continue
        due.append((_utc(heard), int(run_id)))
    return [run_id for _, run_id in sorted(due, reverse=True)]


def refresh_run_timelines(db: Database) -> list[int]:
    """The sweep that keeps run timelines (the embedded pool's every 30 s, procrastinate's
    ``sweep_pending``): GETs never write them (issue #21). Each run is read in a read-only session
    (a 10-million-step run takes ~10 s, without holding SQLite's write lock) and kept in a short
    transaction of its own; the runs it kept."""
    with db.session(read_only=True) as session:
        due = stale_run_timelines(session, refresh_s=db.settings.run_timeline_refresh_s)[:SWEEP_RUNS]
    kept: list[int] = []
    started = time.monotonic()
    for run_id in due:
        if run_id != due[0] and time.monotonic() - started > SWEEP_BUDGET_S:
            break
        try:
            with db.session(read_only=True) as session:
                basis, count = _basis(session, run_id)
                timeline = _compute(session, run_id) if count else None
            if timeline is None:  # no steps yet: asked again at the next sweep
                continue
            with db.session() as session:
                cached = session.get(RunTimelineCache, run_id)
                if (
                    cached is not None
                    and cached.engine_version == ENGINE_VERSION
                    and _basis_count(cached.basis) >= count
                ):
                    continue  # another worker kept this basis or a later one meanwhile
                _upsert(session, run_id, basis, timeline)
            kept.append(run_id)
        except (IntegrityError, OperationalError) as exc:  # kept meanwhile, or the database is busy
            logger.info("run %s: the run timeline was not kept (%s)", run_id, type(exc).__name__)
    return kept


SWEEPS.append(refresh_run_timelines)


# --- storing a chunk ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    """A stored chunk (``replay``: it was already there, byte for byte)."""

    run_id: int
    stream: str
    seq: int
    first_step: int
    last_step: int
    replay: bool


def invalid(message: str) -> ApiError:
    return ApiError(422, "invalid_series_chunk", message)


def check_chunk(data: bytes) -> Chunk:
    """The engine's reader over ``data``; 422 with its one line when the chunk is unusable."""
    try:
        return validate_chunk(data)
    except SeriesError as exc:
        raise invalid(str(exc)) from None


def store_chunk(
    session: Session,
    run: Run,
    data: bytes,
    *,
    chunk: Chunk | None = None,
    received_at: datetime | None = None,
) -> Stored:
    """Validate ``data`` (unless ``chunk`` is its :func:`check_chunk`) and store it in ``run`` (the
    session only flushes); 422 naming the problem when the chunk is bad or overlaps a stored chunk
    of its process, with nothing kept."""
    chunk = chunk if chunk is not None else check_chunk(data)
    received_at = received_at or utcnow()
    sha256 = hashlib.sha256(data).hexdigest()
    last = chunk.last_step
    final = bool(chunk.header.get("final"))
    t_end = chunk.header.get("t_end")
    heartbeat = received_at
    if isinstance(t_end, int | float) and not isinstance(t_end, bool) and t_end > 0:
        # the agent's clock says when the process was last seen; never later than its arrival
        heartbeat = min(received_at, datetime.fromtimestamp(float(t_end), timezone.utc))
    stream = _get_or_create_stream(session, run.id, chunk.stream, chunk.rank, heartbeat)
    known = session.scalar(
        select(SeriesChunk).where(SeriesChunk.stream_id == stream.id, SeriesChunk.seq == chunk.seq)
    )
    if known is not None:
        if known.sha256 != sha256:
            raise invalid(
                f"series chunk {chunk.seq} of process {chunk.stream} is already stored with other content "
                f"(steps {known.first_step}-{known.last_step})"
            )
        return Stored(run.id, chunk.stream, chunk.seq, known.first_step, known.last_step, True)
    if last >= chunk.first_step:
        overlap = session.scalar(
            select(SeriesChunk)
            .where(
                SeriesChunk.stream_id == stream.id,
                SeriesChunk.first_step <= last,
                SeriesChunk.last_step >= chunk.first_step,
            )
            .limit(1)
        )
        if overlap is not None:
            raise invalid(
                f"series chunk {chunk.seq} (steps {chunk.first_step}-{last}) overlaps stored chunk "
                f"{overlap.seq} (steps {overlap.first_step}-{overlap.last_step}) of process {chunk.stream}"
            )
    row = SeriesChunk(
        stream_id=stream.id,
        seq=chunk.seq,
        first_step=chunk.first_step,
        last_step=last,
        count=len(chunk.wall_ns),
        final=final,
        sha256=sha256,
        size_bytes=len(data),
        data=data,
        received_at=received_at,
    )
    try:
        with session.begin_nested():
            session.add(row)
            session.flush()
    except IntegrityError:  # the same chunk, sent twice at once: the other request stored it
        again = session.scalar(
            select(SeriesChunk).where(SeriesChunk.stream_id == stream.id, SeriesChunk.seq == chunk.seq)
        )
        if again is None or again.sha256 != sha256:
            raise invalid(
                f"series chunk {chunk.seq} of process {chunk.stream} conflicts with one stored meanwhile"
            ) from None
        return Stored(run.id, chunk.stream, chunk.seq, again.first_step, again.last_step, True)
    stream.chunks += 1
    stream.steps += row.count
    stream.final = stream.final or final
    if final:  # a final chunk from an agent before the flag is taken as clean
        stream.clean_exit = bool(chunk.header.get("clean_exit", True))
    if _utc(heartbeat) > _utc(stream.heartbeat_at):
        stream.heartbeat_at = heartbeat
    if chunk.rank is not None:
        stream.rank = chunk.rank
    session.flush()
    return Stored(run.id, chunk.stream, chunk.seq, chunk.first_step, last, False)


def _get_or_create_stream(
    session: Session, run_id: int, name: str, rank: int | None, heartbeat: datetime
) -> SeriesStream:
    query = select(SeriesStream).where(SeriesStream.run_id == run_id, SeriesStream.stream == name)
    return get_or_create(
        session,
        query,
        lambda: SeriesStream(
            run_id=run_id,
            stream=name,
            rank=rank,
            chunks=0,
            steps=0,
            heartbeat_at=heartbeat,
            final=False,
            clean_exit=False,
        ),
    )
