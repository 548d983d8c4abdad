"""Read-only catalog: projects, runs (filtered, keyset-paginated) and a run's traces.

Pages are ``{"items": [...], "next": cursor-or-null}``. The cursor is an opaque base64 token
holding the sort key and the last row's (value, id), so pages stay stable while new runs arrive
and each page costs one indexed range scan however deep the client pages.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec
from fastapi import APIRouter, Query
from sqlalchemy import ColumnElement, Select, and_, or_
from sqlalchemy.orm import InstrumentedAttribute, Session

from stepdoctor_analysis import BOTTLENECK_KINDS
from stepdoctor_server.auth.tokens import ReadTeam
from stepdoctor_server.core.database import SessionDep, settings_of
from stepdoctor_server.core.errors import MAX_ID, ApiError
from stepdoctor_server.core.models import Project, Run, Trace
from stepdoctor_server.runs import regressions, series
from stepdoctor_server.runs import service as runs
from stepdoctor_server.runs.series import Liveness
from stepdoctor_server.traces.ingest import NAME_RE, check_tag, validate_name
from stepdoctor_server.web.schemas import (
    ErrorResponse,
    Page,
    ProjectOut,
    RunDetail,
    RunOut,
    TraceSummary,
    as_utc,
)

router = APIRouter(prefix="/api/v1", tags=["catalog"])

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (401, 403, 404, 422)}
RunSort = Literal["created_at", "-created_at", "updated_at", "-updated_at", "name", "-name"]
Limit = Annotated[int, Query(ge=1, le=200, description="page size (1-200)")]
Cursor = Annotated[str | None, Query(max_length=512, description="the previous page's `next`")]

# -- keyset pagination ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Keyset:
    """Sort column and direction; rows are ordered by (column, id) in that direction."""

    sort: str
    column: InstrumentedAttribute[Any] | None  # None: by id only
    descending: bool
    is_time: bool = False


def encode_cursor(keyset: Keyset, value: Any, row_id: int) -> str:
    if isinstance(value, datetime):
        value = as_utc(value).isoformat()
    raw = json.dumps([keyset.sort, value, row_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(keyset: Keyset, cursor: str) -> tuple[Any, int]:
    bad = ApiError(
        422, "invalid_cursor", "invalid cursor: pass the 'next' value of a previous page unchanged"
    )
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        sort, value, row_id = json.loads(raw)
    except (ValueError, TypeError, binascii.Error):
        raise bad from None
    if sort != keyset.sort:
        raise ApiError(422, "invalid_cursor", f"cursor was made for sort={sort!r}, not sort={keyset.sort!r}")
    # Every value goes into SQL: ids in the 32-bit range, names from the name alphabet, times
    # that convert to UTC. Anything else is a forged cursor (422), never a driver error (500).
    if isinstance(row_id, bool) or not isinstance(row_id, int) or not 0 <= row_id <= MAX_ID:
        raise bad
    if keyset.column is None:
        return None, row_id
    if keyset.is_time:
        try:
            value = as_utc(datetime.fromisoformat(value)) if isinstance(value, str) else None
        except (ValueError, OverflowError):
            value = None
    elif not isinstance(value, str) or not NAME_RE.fullmatch(value):
        value = None
    if not isinstance(value, (str, datetime)):
        raise bad
    return value, row_id


def after_cursor(keyset: Keyset, id_column: Any, value: Any, row_id: int) -> ColumnElement[bool]:
    """Rows strictly after (value, row_id) in the keyset's order."""
    if keyset.column is None:
        return id_column < row_id if keyset.descending else id_column > row_id
    col = keyset.column
    if keyset.descending:
        return or_(col < value, and_(col == value, id_column < row_id))
    return or_(col > value, and_(col == value, id_column > row_id))


def order_by(keyset: Keyset, id_column: Any) -> list[Any]:
    columns = [keyset.column, id_column] if keyset.column is not None else [id_column]
    return [c.desc() if keyset.descending else c.asc() for c in columns]


def paginate(
    session: Session, query: Select, keyset: Keyset, id_column: Any, limit: int, cursor: str | None
) -> tuple[list[Any], str | None]:
    """Run ``query`` for one page; the first entity of each row supplies the cursor values."""
    if cursor:
        value, row_id = decode_cursor(keyset, cursor)
        query = query.where(after_cursor(keyset, id_column, value, row_id))
    rows = list(session.execute(query.order_by(*order_by(keyset, id_column)).limit(limit + 1)))
    next_cursor = None
    if len(rows) > limit:
        rows = rows[:limit]
        last = rows[-1][0]
        value = getattr(last, keyset.column.key) if keyset.column is not None else None
        next_cursor = encode_cursor(keyset, value, last.id)
    return rows, next_cursor


def _run_keyset(sort: str) -> Keyset:
    descending = sort.startswith("-")
    name = sort.lstrip("-")
    column = {"created_at": Run.created_at, "updated_at": Run.updated_at, "name": Run.name}[name]
    return Keyset(sort=sort, column=column, descending=descending, is_time=name != "name")


# -- projects ------------------------------------------------------------------------------------


@router.get("/projects", response_model=Page[ProjectOut], responses=_ERRORS, summary="The team's projects")
def list_projects(
    principal: ReadTeam, session: SessionDep, limit: Limit = 50, cursor: Cursor = None
) -> Page[ProjectOut]:
    keyset = Keyset(sort="name", column=Project.name, descending=False)
    rows, next_cursor = paginate(session, runs.projects_query(principal), keyset, Project.id, limit, cursor)
    items = [ProjectOut(id=p.id, name=p.name, created_at=p.created_at, run_count=n) for p, n in rows]
    return Page[ProjectOut](items=items, next=next_cursor)


# -- runs ----------------------------------------------------------------------------------------


def regression_out(run: Run) -> dict[str, Any] | None:
    """The stored regression status, typed and back (another layout reads as none)."""
    status = regressions.read_regression(run.regression)
    out: dict[str, Any] | None = msgspec.to_builtins(status) if status is not None else None
    return out


def _run_out(run: Run, project_name: str, trace_count: int, liveness: Liveness | None = None) -> RunOut:
    return RunOut(
        id=run.id,
        project_id=run.project_id,
        project=project_name,
        name=run.name,
        tags=list(run.tags or []),
        primary_kind=run.primary_kind,
        trace_count=trace_count,
        created_at=run.created_at,
        updated_at=run.updated_at,
        regression=regression_out(run),
        liveness=liveness,
    )


@router.get("/runs", response_model=Page[RunOut], responses=_ERRORS, summary="Runs, filtered and paginated")
def list_runs(
    principal: ReadTeam,
    session: SessionDep,
    project: Annotated[str | None, Query(description="only this project's runs")] = None,
    tag: Annotated[str | None, Query(max_length=128, description="only runs carrying this tag")] = None,
    primary_kind: Annotated[str | None, Query(description="only runs diagnosed with this bottleneck")] = None,
    since: Annotated[
        datetime | None, Query(description="created at or after (ISO 8601; UTC if naive)")
    ] = None,
    until: Annotated[datetime | None, Query(description="created before (ISO 8601; UTC if naive)")] = None,
    sort: RunSort = "-created_at",
    limit: Limit = 50,
    cursor: Cursor = None,
) -> Page[RunOut]:
    # Checked in the order of the parameters, so the first bad one is the one named.
    project = validate_name("project", project) if project is not None else None
    tag = check_tag(tag, "tag filter") if tag is not None else None
    if primary_kind is not None and primary_kind not in BOTTLENECK_KINDS:
        raise ApiError(422, "invalid_request", f"primary_kind must be one of {', '.join(BOTTLENECK_KINDS)}")
    since = _bounded_time("since", since) if since is not None else None
    until = _bounded_time("until", until) if until is not None else None
    query = runs.catalog_query(
        session, principal, project=project, tag=tag, primary_kind=primary_kind, since=since, until=until
    )
    rows, next_cursor = paginate(session, query, _run_keyset(sort), Run.id, limit, cursor)
    alive = series.liveness_of_runs(session, [r.id for r, _, _ in rows])
    return Page[RunOut](items=[_run_out(r, p, n, alive[r.id]) for r, p, n in rows], next=next_cursor)


def _bounded_time(name: str, value: datetime) -> datetime:
    """A filter time in UTC; years 1-9999 only (a time zone can push the edges out of range)."""
    try:
        return as_utc(value)
    except OverflowError:
        raise ApiError(
            422, "invalid_request", f"query parameter '{name}': out of range once converted to UTC"
        ) from None


@router.get("/runs/{run_id}", response_model=RunDetail, responses=_ERRORS, summary="A run and its diagnosis")
def get_run(run_id: int, principal: ReadTeam, session: SessionDep) -> RunDetail:
    run, project = runs.load_run(session, principal, run_id)
    counts = runs.trace_status_counts(session, run.id)
    base = _run_out(run, project.name, sum(counts.values()), series.liveness_of(session, run.id))
    timeline = series.run_timeline_of(
        session, run.id, fresh_within_s=settings_of(session).run_timeline_refresh_s
    )
    return RunDetail(
        **base.model_dump(),
        diagnosis=run.diagnosis,
        diagnosis_engine_version=run.diagnosis_engine_version,
        trace_status=counts,
        run_timeline=timeline.to_dict() if timeline is not None else None,
    )


@router.get(
    "/runs/{run_id}/traces", response_model=Page[TraceSummary], responses=_ERRORS, summary="A run's traces"
)
def list_run_traces(
    run_id: int, principal: ReadTeam, session: SessionDep, limit: Limit = 50, cursor: Cursor = None
) -> Page[TraceSummary]:
    run, _ = runs.load_run(session, principal, run_id)
    keyset = Keyset(sort="id", column=None, descending=False)
    rows, next_cursor = paginate(session, runs.traces_query(run.id), keyset, Trace.id, limit, cursor)
    items = [trace_summary(t, kind, share) for t, kind, share in rows]
    return Page[TraceSummary](items=items, next=next_cursor)


def trace_summary(trace: Trace, primary_kind: str | None, primary_share: float | None) -> TraceSummary:
    return TraceSummary(
        id=trace.id,
        run_id=trace.run_id,
        rank=trace.rank,
        window_index=trace.window_index,
        first_step=trace.first_step,
        last_step=trace.last_step,
        size_bytes=trace.size_bytes,
        sha256=trace.sha256,
        filename=trace.filename,
        status=trace.status,
        status_reason=trace.status_reason,
        attempts=trace.attempts,
        primary_kind=primary_kind,
        primary_share=primary_share,
        created_at=trace.created_at,
        updated_at=trace.updated_at,
    )
