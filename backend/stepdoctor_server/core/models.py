"""SQLAlchemy 2.0 models: the whole schema (it exists in the database only through migrations).

Relationships are ``lazy="raise"`` so nothing loads by accident; queries say what they join.
The ``traces`` table doubles as the analysis job queue (status pending -> running -> done|failed);
``deep_analyses`` is a second queue of the same shape for the optional HTA analyses.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_N_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

SCOPES = ("upload", "read", "admin")
TRACE_STATUSES = ("pending", "running", "done", "failed")
DEEP_KINDS = ("critical_path",)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


# Client-supplied JSON (metadata, tags) is jsonb on PostgreSQL: validated on the way in, indexable,
# and a bad value fails at insert (422) instead of breaking every later json -> jsonb cast.
ClientJSON = JSON().with_variant(JSONB(), "postgresql")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {  # noqa: RUF012 - SQLAlchemy reads this class attribute
        datetime: DateTime(timezone=True),
        dict[str, Any]: JSON(),
        list[str]: JSON(),
    }


class Team(Base):
    __tablename__ = "teams"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    tokens: Mapped[list[Token]] = relationship(back_populates="team", lazy="raise")
    projects: Mapped[list[Project]] = relationship(back_populates="team", lazy="raise")


class Token(Base):
    """An API token; only its sha256 is stored, plus a short prefix so people can tell them apart."""

    __tablename__ = "tokens"
    __table_args__ = (CheckConstraint(_in("scope", SCOPES), name="scope"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    team_id: Mapped[int] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    scope: Mapped[str] = mapped_column(String(16))
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]
    expires_at: Mapped[datetime | None]

    team: Mapped[Team] = relationship(back_populates="tokens", lazy="raise")


class Project(Base):
    __tablename__ = "projects"
    __table_args__ = (UniqueConstraint("team_id", "name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    team_id: Mapped[int] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    team: Mapped[Team] = relationship(back_populates="projects", lazy="raise")
    runs: Mapped[list[Run]] = relationship(back_populates="project", lazy="raise")


class Run(Base):
    """A training run; ``diagnosis`` is the run-level aggregate the analysis worker writes."""

    __tablename__ = "runs"
    __table_args__ = (
        UniqueConstraint("project_id", "name"),
        Index("ix_runs_project_id_created_at", "project_id", "created_at"),
        Index("ix_runs_created_at", "created_at"),
        Index("ix_runs_primary_kind", "primary_kind"),
        # The dashboard's run-list sorts (migration 2026_11_22_1800).
        Index("ix_runs_updated_at", "updated_at"),
        Index("ix_runs_name", "name"),
        Index("ix_runs_project_id_updated_at", "project_id", "updated_at"),
        Index("ix_runs_project_id_primary_kind_updated_at", "project_id", "primary_kind", "updated_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    tags: Mapped[list[str]] = mapped_column(ClientJSON, default=list)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    primary_kind: Mapped[str | None] = mapped_column(String(32))
    diagnosis: Mapped[dict[str, Any] | None]
    diagnosis_engine_version: Mapped[str | None] = mapped_column(String(32))
    # Digest of the trace states and analysis ids the diagnosis was built from (skip redundant
    # re-aggregation), and how many times it was computed (operations, tests).
    diagnosis_basis: Mapped[str | None] = mapped_column(String(64))
    aggregations: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Its regression status against the project's baseline (``runs.regressions.RegressionStatus``),
    # written by the run-diagnosis job, read by the pages and the API.
    regression: Mapped[dict[str, Any] | None]

    project: Mapped[Project] = relationship(back_populates="runs", lazy="raise")
    traces: Mapped[list[Trace]] = relationship(back_populates="run", lazy="raise")


class Trace(Base):
    """One uploaded trace file (one rank, one profiling window) and its analysis job state.

    ``team_id`` is denormalised from run -> project so the Idempotency-Key can be unique per team.
    """

    __tablename__ = "traces"
    __table_args__ = (
        UniqueConstraint("team_id", "idempotency_key"),
        CheckConstraint(_in("status", TRACE_STATUSES), name="status"),
        Index("ix_traces_status_created_at", "status", "created_at"),
        Index("ix_traces_status_priority_created_at", "status", "priority", "created_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    team_id: Mapped[int] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"))
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int | None]
    window_index: Mapped[int | None]
    first_step: Mapped[int | None]
    last_step: Mapped[int | None]
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    storage_key: Mapped[str] = mapped_column(String(255), unique=True)
    filename: Mapped[str] = mapped_column(String(255))
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    # ``metadata`` is reserved on declarative classes, hence the attribute name.
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", ClientJSON, default=dict)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    status_reason: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Claim order is (priority, created_at): fresh uploads 0, re-analyses 1, so a requeued backlog
    # never delays another team's new upload by more than the jobs already running.
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    claimed_by: Mapped[str | None] = mapped_column(String(255))
    claimed_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    run: Mapped[Run] = relationship(back_populates="traces", lazy="raise")
    analysis: Mapped[Analysis | None] = relationship(back_populates="trace", lazy="raise")


class Analysis(Base):
    """The engine's report for one trace (``report`` is ``Report.to_dict()``)."""

    __tablename__ = "analyses"

    id: Mapped[int] = mapped_column(primary_key=True)
    trace_id: Mapped[int] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"), unique=True)
    engine_version: Mapped[str] = mapped_column(String(32))
    schema_version: Mapped[int]
    primary_kind: Mapped[str | None] = mapped_column(String(32))
    primary_share: Mapped[float | None] = mapped_column(Float)
    report: Mapped[dict[str, Any]]
    duration_ms: Mapped[int | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    trace: Mapped[Trace] = relationship(back_populates="analysis", lazy="raise")


class DeepAnalysis(Base):
    """An on-demand HTA analysis of one trace (``result`` is e.g. ``deep.critical_path(...)``).

    A job row like ``traces`` (same status/claim columns, claimed by the same queue code), kept
    apart because it is optional, slower and requested per parameters. ``params_key`` is the
    canonical JSON of ``params``, so one request per (trace, kind, parameters) exists.
    """

    __tablename__ = "deep_analyses"
    __table_args__ = (
        UniqueConstraint("trace_id", "kind", "params_key"),
        CheckConstraint(_in("kind", DEEP_KINDS), name="kind"),
        CheckConstraint(_in("status", TRACE_STATUSES), name="status"),
        Index("ix_deep_analyses_status_created_at", "status", "created_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    trace_id: Mapped[int] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(32))
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    params_key: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16), default="pending")
    status_reason: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    claimed_by: Mapped[str | None] = mapped_column(String(255))
    claimed_at: Mapped[datetime | None]
    result: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class DashboardSession(Base):
    """A dashboard login: the cookie holds a random id, the table its sha256 (never the API token).

    The session acts with its token's team and scope, so revoking or expiring the token ends it.
    """

    __tablename__ = "dashboard_sessions"

    id: Mapped[int] = mapped_column(primary_key=True)
    token_id: Mapped[int] = mapped_column(ForeignKey("tokens.id", ondelete="CASCADE"), index=True)
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(index=True)


class SeriesStream(Base):
    """One agent process's step series in a run (``stepdoctor.series``; a restart is a new stream).

    Kept up to date as chunks arrive, so liveness (``runs.series.liveness_of``) reads a few rows per
    run, never the chunks: ``heartbeat_at`` is the latest chunk's time (the agent's clock, capped at
    the time it reached us), ``final`` whether the process wrote its exit chunk.
    """

    __tablename__ = "series_streams"
    __table_args__ = (UniqueConstraint("run_id", "stream"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    stream: Mapped[str] = mapped_column(String(64))
    rank: Mapped[int | None]
    chunks: Mapped[int] = mapped_column(Integer, default=0)
    steps: Mapped[int] = mapped_column(BigInteger, default=0)
    heartbeat_at: Mapped[datetime]
    final: Mapped[bool] = mapped_column(Boolean, default=False)
    # The final chunk says the loop ended without an exception (agents before the flag: final is clean).
    clean_exit: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class SeriesChunk(Base):
    """One step-series chunk as the agent wrote it (``data``: the chunk's bytes, validated on the way in).

    The bytes stay as they are (zlib-compressed int64 columns, ~2 bytes a step): the engine's
    ``run_timeline`` reads them back, so ``check`` and the run page see every step the agent saw.
    """

    __tablename__ = "series_chunks"
    __table_args__ = (
        UniqueConstraint("stream_id", "seq"),
        Index("ix_series_chunks_stream_id_first_step", "stream_id", "first_step"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    stream_id: Mapped[int] = mapped_column(ForeignKey("series_streams.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)  # first_step - 1 for a chunk without steps
    count: Mapped[int] = mapped_column(Integer)
    final: Mapped[bool] = mapped_column(Boolean, default=False)
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(Integer)
    data: Mapped[bytes] = mapped_column(LargeBinary)
    received_at: Mapped[datetime] = mapped_column(default=utcnow)


class RunTimelineCache(Base):
    """A run's ``RunTimeline`` as last computed (``to_dict()``), valid while ``basis`` (the chunks it
    was built from) and the engine version match: the page and API of a 10-million-step run read
    this instead of decompressing every chunk again."""

    __tablename__ = "run_timelines"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    basis: Mapped[str] = mapped_column(String(64))
    engine_version: Mapped[str] = mapped_column(String(32))
    timeline: Mapped[dict[str, Any]]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class ProjectBaseline(Base):
    """The run a project's runs are compared with (chosen by an upload or admin token); without a
    row, the median of the project's last finished runs (``runs.regressions``)."""

    __tablename__ = "project_baselines"

    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


WEBHOOK_STATUSES = ("pending", "delivered", "failed")


class WebhookDelivery(Base):
    """One regression's webhook POST, and the queue its sender claims (``runs.webhook``).

    Unique per (run, signature): a regression of one run is announced once, however often its
    status is recomputed. ``next_attempt_at`` carries the exponential backoff between tries.
    """

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("run_id", "signature"),
        CheckConstraint(_in("status", WEBHOOK_STATUSES), name="status"),
        Index("ix_webhook_deliveries_status_next_attempt_at", "status", "next_attempt_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    signature: Mapped[str] = mapped_column(String(255))
    payload: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_error: Mapped[str | None] = mapped_column(Text)
    claimed_by: Mapped[str | None] = mapped_column(String(255))
    claimed_at: Mapped[datetime | None]
    delivered_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


CAPTURE_STATUSES = ("pending", "captured", "failed")


class CaptureRequest(Base):
    """A "Capture now" click on a live run's page, and the queue its agent polls (``runs.capture``).

    ``pending_run_id`` is the run's id while the request is pending and NULL after: unique, so a run
    has at most one pending request (NULLs never collide, on SQLite and PostgreSQL alike). The agent
    acknowledges with the captured window's ``trace_key`` (its upload's Idempotency-Key), which
    names the trace once it arrives; ``detail`` says why a window could not be captured.
    """

    __tablename__ = "capture_requests"
    __table_args__ = (CheckConstraint(_in("status", CAPTURE_STATUSES), name="status"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    pending_run_id: Mapped[int | None] = mapped_column(unique=True)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    requested_at: Mapped[datetime] = mapped_column(default=utcnow)
    requested_by: Mapped[int | None] = mapped_column(ForeignKey("tokens.id", ondelete="SET NULL"))
    acknowledged_at: Mapped[datetime | None]
    rank: Mapped[int | None]
    trace_key: Mapped[str | None] = mapped_column(String(128))
    detail: Mapped[str | None] = mapped_column(Text)


class TraceSummaryRecord(Base):
    """One analysis's compact record for its run's verdict (``stepdoctor_analysis.run.trace_summary``,
    msgspec JSON), built once per analysis so a run's verdict never re-reads every report
    (``runs.diagnosis``). ``summary`` is NULL when the report does not decode (counted outdated).
    Keyed by the analysis: a re-analysis deletes the old analysis, and with it this row."""

    __tablename__ = "rank_summaries"

    analysis_id: Mapped[int] = mapped_column(ForeignKey("analyses.id", ondelete="CASCADE"), primary_key=True)
    trace_id: Mapped[int] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    summary: Mapped[bytes | None] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class MemorySnapshot(Base):
    """A CUDA allocator snapshot stored beside its trace (the agent's ``memory_snapshot=True``): torch's
    ``torch.cuda.memory._snapshot()`` pickled, for https://pytorch.org/memory_viz. Stored and served as
    bytes, never unpickled (``traces.snapshots``); one per trace."""

    __tablename__ = "memory_snapshots"

    id: Mapped[int] = mapped_column(primary_key=True)
    trace_id: Mapped[int] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"), unique=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    protocol: Mapped[int]  # the pickle protocol its header names
    storage_key: Mapped[str] = mapped_column(String(255), unique=True)
    filename: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
