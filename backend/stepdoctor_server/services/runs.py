"""Runs: the caller's run, its stored diagnosis and trace counts, tag filters, its TensorBoard export."""

from __future__ import annotations

import re
from typing import Any

from fastapi.responses import StreamingResponse
from sqlalchemy import ColumnElement, cast, exists, func, select
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from stepdoctor_server import tensorboard_export
from stepdoctor_server.auth import Principal
from stepdoctor_server.errors import ApiError, check_id, not_found
from stepdoctor_server.models import Project, Run, Trace
from stepdoctor_server.storage import TraceStore


def load_run(session: Session, principal: Principal, run_id: int) -> tuple[Run, Project]:
    """The run and its project if they belong to the caller's team (else 404)."""
    check_id("run", run_id)
    row = session.execute(
        select(Run, Project)
        .join(Project, Project.id == Run.project_id)
        .where(Run.id == run_id, Project.team_id == principal.team_id)
    ).first()
    if row is None:
        raise not_found("run", run_id)
    run, project = row
    return run, project


def trace_status_counts(session: Session, run_id: int) -> dict[str, int]:
    """How many of the run's traces are in each status (absent statuses are left out)."""
    query = select(Trace.status, func.count(Trace.id)).where(Trace.run_id == run_id).group_by(Trace.status)
    return {str(status): int(n) for status, n in session.execute(query)}


def run_diagnosis(run: Run) -> dict[str, Any]:
    """The run's stored diagnosis, which the worker refreshes as its traces finish; 409 while it has none.

    Reading it (rather than re-aggregating every report on the request path) keeps compare, the run
    page and ``GET /runs/{id}`` on one source of truth.
    """
    if not run.diagnosis or not run.diagnosis.get("traces"):
        raise ApiError(409, "not_analyzed", f"run {run.id} has no analysed traces yet")
    return run.diagnosis


def has_tag(session: Session, tag: str) -> ColumnElement[bool]:
    """Tags are a JSON list; containment is dialect-specific (jsonb @> on PostgreSQL, json_each on SQLite)."""
    if session.get_bind().dialect.name == "postgresql":
        return cast(Run.tags, JSONB).contains([tag])
    each = func.json_each(Run.tags).table_valued("value")
    return exists(select(1).select_from(each).where(each.c.value == tag))


_HEADER_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def tensorboard_zip(
    session: Session, principal: Principal, store: TraceStore, run_id: int
) -> StreamingResponse:
    """The run's stored traces as a zipped TensorBoard profiler log directory; 409 when none is left."""
    run, project = load_run(session, principal, run_id)
    traces = session.scalars(
        select(Trace).where(Trace.run_id == run.id, Trace.status != "failed").order_by(Trace.id)
    ).all()
    items = [
        tensorboard_export.ExportItem(
            path=store.source(t.storage_key),
            rank=t.rank,
            window_index=t.window_index,
            host=_host(t.meta),
            trace_id=t.id,
        )
        for t in traces
    ]
    items = [i for i, t in zip(items, traces, strict=True) if store.exists(t.storage_key)]
    if not items:
        raise ApiError(409, "empty", f"run {run.id} has no exportable traces")
    members = tensorboard_export.archive_names(run.name, items)
    # Names are validated on the way in; rows from before full-match validation may hold a
    # trailing newline, which would make the header invalid (and drop the connection).
    filename = _HEADER_UNSAFE.sub("_", f"{project.name}_{run.name}_tensorboard.zip")
    return StreamingResponse(
        tensorboard_export.stream_zip(members),
        media_type="application/zip",
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )


def _host(meta: dict[str, Any] | None) -> str | None:
    host = (meta or {}).get("host") or (meta or {}).get("hostname")
    return str(host) if host else None
