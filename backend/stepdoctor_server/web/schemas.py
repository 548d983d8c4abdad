"""Pydantic models at the API edge (kept apart from the SQLAlchemy models on purpose)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema

from stepdoctor_analysis.report.contract import inline_schema

T = TypeVar("T")


def as_utc(value: datetime) -> datetime:
    """SQLite hands back naive datetimes; everything we store is UTC."""
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


UTCDateTime = Annotated[datetime, AfterValidator(as_utc)]

# A stored report, passed through as the worker wrote it (reports from older engines included: no
# decode on the request path), documented in OpenAPI by the engine's typed contract
# (``stepdoctor_analysis.report.contract.ReportDoc``). Inlined, because the contract's ``$defs`` would not
# resolve inside an OpenAPI document and registering components would need the app's openapi().
ReportJSON = Annotated[dict[str, Any], WithJsonSchema(inline_schema())]


class ErrorDetail(BaseModel):
    code: str = Field(description="stable machine-readable code, e.g. 'payload_too_large'")
    message: str = Field(description="one human-readable line")


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Page(BaseModel, Generic[T]):
    items: list[T]
    next: str | None = Field(description="cursor for the next page; null on the last page")


class UploadResult(BaseModel):
    id: int
    run_id: int
    status: str


class AnalysisOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    engine_version: str
    schema_version: int
    primary_kind: str | None
    primary_share: float | None
    duration_ms: int | None
    created_at: UTCDateTime
    report: ReportJSON


class TraceSummary(BaseModel):
    id: int
    run_id: int
    rank: int | None
    window_index: int | None
    first_step: int | None
    last_step: int | None
    size_bytes: int
    sha256: str
    filename: str
    status: str
    status_reason: str | None
    attempts: int
    primary_kind: str | None = None
    primary_share: float | None = None
    created_at: UTCDateTime
    updated_at: UTCDateTime


class TraceOut(TraceSummary):
    project: str
    run: str
    metadata: dict[str, Any]
    download_url: str
    analysis: AnalysisOut | None
    stale: bool = False  # the analysis is from an older engine; a re-analysis is queued
    # the window's CUDA memory snapshot (agent ``memory_snapshot=True``), for https://pytorch.org/memory_viz
    memory_snapshot_url: str | None = None


class ProjectOut(BaseModel):
    id: int
    name: str
    created_at: UTCDateTime
    run_count: int


class RunOut(BaseModel):
    id: int
    project_id: int
    project: str
    name: str
    tags: list[str]
    primary_kind: str | None
    trace_count: int
    created_at: UTCDateTime
    updated_at: UTCDateTime
    liveness: Literal["live", "finished", "stopped"] | None = Field(
        default=None,
        description="from the agent's step-series heartbeats: live, finished (the process exited cleanly) "
        "or stopped (no heartbeat for 5 minutes, no clean exit); null for a run without a step series",
    )

    regression: dict[str, Any] | None = Field(
        default=None,
        description="the run against its project's baseline (runs.regressions.RegressionStatus): regressed, "
        "reasons (step_time, verdict), comparison (basis, candidate_ms, baseline_ms, change, verdicts), "
        "baseline (chosen run or median of recent runs); null before its first diagnosis",
    )


class RunDetail(RunOut):
    diagnosis: dict[str, Any] | None
    diagnosis_engine_version: str | None
    trace_status: dict[str, int] = Field(description="number of traces per status")
    run_timeline: dict[str, Any] | None = Field(
        default=None,
        description="the engine's RunTimeline over every step the agent timed (what `stepdoctor analyze "
        "RUN_DIR --format json` gives as run_timeline); null for a run without a step series",
    )


class HealthOut(BaseModel):
    status: str
