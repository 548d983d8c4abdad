"""Analysis endpoints: re-analysis, fresh reports, run comparison, the TensorBoard export and the
optional deep (HTA) analyses.

Nothing here analyses anything: the endpoints only move jobs back to ``pending`` for the worker
processes, read stored reports and stream stored files.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from stepdoctor_server import compare, tensorboard_export
from stepdoctor_server.api_catalog import load_run
from stepdoctor_server.api_traces import load_trace, public_report
from stepdoctor_server.auth import AdminTeam, Principal, ReadTeam, UploadTeam
from stepdoctor_server.db import SessionDep
from stepdoctor_server.errors import ApiError
from stepdoctor_server.models import Analysis, DeepAnalysis, Run, Trace
from stepdoctor_server.queue import is_outdated, request_deep_analysis, requeue_if_stale, reset_to_pending
from stepdoctor_server.schemas import ErrorResponse, ReportJSON
from stepdoctor_server.storage import TraceStore

router = APIRouter(prefix="/api/v1", tags=["analysis"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (401, 403, 404, 409, 422)
}


class Requeued(BaseModel):
    ids: list[int] = Field(description="trace ids queued for analysis")
    status: str = "pending"


class ReportOut(BaseModel):
    trace_id: int
    status: str
    status_reason: str | None
    stale: bool = Field(description="true when the report comes from an older engine and is being redone")
    report: ReportJSON | None


class CompareOut(BaseModel):
    base: dict[str, Any]
    other: dict[str, Any]
    comparison: dict[str, Any]


@router.post(
    "/traces/{trace_id}/reanalyze",
    status_code=202,
    response_model=Requeued,
    responses=_ERRORS,
    summary="Queue a trace for analysis again (admin token; runs after every fresh upload)",
)
def reanalyze_trace(trace_id: int, principal: AdminTeam, session: SessionDep) -> Requeued:
    """Admin only, and queued behind fresh uploads (priority 1), so it can never flood the queue."""
    trace, _, _ = load_trace(session, principal, trace_id)
    reset_to_pending(session, [trace.id])
    return Requeued(ids=[trace.id])


@router.post(
    "/runs/{run_id}/reanalyze",
    status_code=202,
    response_model=Requeued,
    responses=_ERRORS,
    summary="Queue every trace of a run for analysis again (admin token; runs after every fresh upload)",
)
def reanalyze_run(run_id: int, principal: AdminTeam, session: SessionDep) -> Requeued:
    """Admin only: one call can requeue thousands of traces (they wait behind fresh uploads)."""
    run, _ = load_run(session, principal, run_id)
    ids = list(session.scalars(select(Trace.id).where(Trace.run_id == run.id).order_by(Trace.id)))
    reset_to_pending(session, ids)
    return Requeued(ids=ids)


@router.get(
    "/traces/{trace_id}/report",
    response_model=ReportOut,
    responses=_ERRORS,
    summary="The trace's report; one from an older engine is re-queued and returned marked stale",
)
def get_report(trace_id: int, principal: ReadTeam, session: SessionDep) -> ReportOut:
    trace, _, _ = load_trace(session, principal, trace_id)
    analysis = session.scalar(select(Analysis).where(Analysis.trace_id == trace.id))
    stale = requeue_if_stale(session, trace, analysis)
    return ReportOut(
        trace_id=trace.id,
        status=trace.status,
        status_reason=trace.status_reason,
        stale=stale,
        report=public_report(analysis.report, trace.filename) if analysis is not None else None,
    )


class RunDiagnosisOut(BaseModel):
    run_id: int
    stale: bool = Field(description="true while traces analysed by an older engine are being redone")
    requeued: list[int] = Field(description="trace ids this request queued for re-analysis")
    trace_status: dict[str, int]
    diagnosis: dict[str, Any] | None


@router.get(
    "/runs/{run_id}/diagnosis",
    response_model=RunDiagnosisOut,
    responses=_ERRORS,
    summary="The run's diagnosis; traces analysed by an older engine are re-queued and it is marked stale",
)
def get_run_diagnosis(run_id: int, principal: ReadTeam, session: SessionDep) -> RunDiagnosisOut:
    run, _ = load_run(session, principal, run_id)
    rows = session.execute(
        select(Trace.id, Trace.status, Analysis.engine_version, Analysis.schema_version)
        .join(Analysis, Analysis.trace_id == Trace.id)
        .where(Trace.run_id == run.id)
    ).all()
    outdated = [r for r in rows if is_outdated(r.engine_version, r.schema_version)]
    requeue = [r.id for r in outdated if r.status in ("done", "failed")]
    reset_to_pending(session, requeue)
    counts = dict(
        session.execute(
            select(Trace.status, func.count(Trace.id)).where(Trace.run_id == run.id).group_by(Trace.status)
        ).all()
    )
    return RunDiagnosisOut(
        run_id=run.id,
        stale=bool(outdated),
        requeued=sorted(requeue),
        trace_status={str(k): int(v) for k, v in counts.items()},
        diagnosis=run.diagnosis,
    )


@router.get(
    "/compare",
    response_model=CompareOut,
    responses=_ERRORS,
    summary="Compare two runs: per-category step-time deltas, speedup, findings resolved/appeared",
)
def compare_runs(
    principal: ReadTeam,
    session: SessionDep,
    base: int = Query(description="id of the baseline run"),
    other: int = Query(description="id of the run compared with it"),
) -> CompareOut:
    base_run, base_project = load_run(session, principal, base)
    other_run, other_project = load_run(session, principal, other)
    base_diag = run_diagnosis(base_run)
    other_diag = run_diagnosis(other_run)
    return CompareOut(
        base={"id": base_run.id, "project": base_project.name, "name": base_run.name, "diagnosis": base_diag},
        other={
            "id": other_run.id,
            "project": other_project.name,
            "name": other_run.name,
            "diagnosis": other_diag,
        },
        comparison=compare.compare_diagnoses(base_diag, other_diag),
    )


def run_diagnosis(run: Run) -> dict[str, Any]:
    """The run's stored diagnosis, which the worker refreshes as its traces finish; 409 while it has none.

    Reading it (rather than re-aggregating every report on the request path) keeps compare, the run
    page and ``GET /runs/{id}`` on one source of truth.
    """
    if not run.diagnosis or not run.diagnosis.get("traces"):
        raise ApiError(409, "not_analyzed", f"run {run.id} has no analysed traces yet")
    return run.diagnosis


@router.get(
    "/runs/{run_id}/tensorboard.zip",
    response_class=StreamingResponse,
    responses={200: {"description": "a zipped TensorBoard log directory"}, **_ERRORS},
    summary="The run's traces as a TensorBoard profiler log directory (unzip, tensorboard --logdir DIR)",
)
def tensorboard_zip(run_id: int, request: Request, principal: ReadTeam, session: SessionDep) -> Any:
    run, project = load_run(session, principal, run_id)
    store: TraceStore = request.app.state.store
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


_HEADER_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def _host(meta: dict[str, Any] | None) -> str | None:
    host = (meta or {}).get("host") or (meta or {}).get("hostname")
    return str(host) if host else None


# -- deep analyses (Holistic Trace Analysis, optional extra) -------------------------------------


class DeepAnalysisOut(BaseModel):
    id: int
    trace_id: int
    kind: str
    params: dict[str, Any]
    status: str = Field(description="pending | running | done | failed")
    status_reason: str | None
    attempts: int
    result: dict[str, Any] | None = Field(description="e.g. critical path: length_us, breakdown, top, ...")
    created_at: datetime
    updated_at: datetime


def deep_out(job: DeepAnalysis) -> DeepAnalysisOut:
    return DeepAnalysisOut(
        id=job.id,
        trace_id=job.trace_id,
        kind=job.kind,
        params=dict(job.params or {}),
        status=job.status,
        status_reason=job.status_reason,
        attempts=job.attempts,
        result=job.result,
        created_at=job.created_at,
        updated_at=job.updated_at,
    )


def request_critical_path(
    session: Session, principal: Principal, trace_id: int, *, step: int | None, force: bool
) -> tuple[DeepAnalysis, bool]:
    """The service behind the API and the dashboard button: 404 others' traces, 501 without HTA."""
    from stepdoctor_analysis import deep

    trace, _, _ = load_trace(session, principal, trace_id)
    if not deep.available():
        raise ApiError(
            501,
            "hta_not_installed",
            f"deep analyses need Holistic Trace Analysis on the server: {deep.INSTALL_HINT}",
        )
    params: dict[str, Any] = {} if step is None else {"step": step}
    return request_deep_analysis(session, trace.id, "critical_path", params, force=force)


@router.post(
    "/traces/{trace_id}/deep/critical-path",
    status_code=202,
    response_model=DeepAnalysisOut,
    responses={
        200: {"model": DeepAnalysisOut, "description": "the same request is already queued or done"},
        501: {"model": ErrorResponse, "description": "HTA (stepdoctor[hta]) is not installed"},
        **_ERRORS,
    },
    summary="Queue HTA's critical-path analysis of one step of the trace (idempotent; force=true redoes it)",
)
def post_critical_path(
    trace_id: int,
    principal: UploadTeam,
    session: SessionDep,
    response: Response,
    step: Annotated[int | None, Query(ge=0, lt=2**31, description="ProfilerStep number")] = None,
    force: Annotated[bool, Query(description="redo even if already done")] = False,
) -> DeepAnalysisOut:
    job, queued = request_critical_path(session, principal, trace_id, step=step, force=force)
    if not queued:
        response.status_code = 200
    return deep_out(job)


@router.get(
    "/traces/{trace_id}/deep",
    response_model=list[DeepAnalysisOut],
    responses=_ERRORS,
    summary="The trace's deep (HTA) analyses with their status and results",
)
def list_deep(trace_id: int, principal: ReadTeam, session: SessionDep) -> list[DeepAnalysisOut]:
    trace, _, _ = load_trace(session, principal, trace_id)
    return [deep_out(job) for job in deep_analyses(session, trace.id)]


def deep_analyses(session: Session, trace_id: int) -> list[DeepAnalysis]:
    """A trace's deep analyses, newest first."""
    return list(
        session.scalars(
            select(DeepAnalysis)
            .where(DeepAnalysis.trace_id == trace_id)
            .order_by(DeepAnalysis.created_at.desc(), DeepAnalysis.id.desc())
        )
    )
