"""Analysis endpoints: re-analysis, fresh reports, run comparison, the TensorBoard export and the
optional deep (HTA) analyses.

Nothing here analyses anything: the endpoints only move jobs back to ``pending`` for the worker
processes, read stored reports and stream stored files.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from sqlalchemy import select

from stepdoctor_analysis.run.verdict import RunVerdict
from stepdoctor_server.auth.tokens import AdminTeam, ReadTeam, UploadTeam
from stepdoctor_server.core.database import SessionDep
from stepdoctor_server.core.models import DeepAnalysis, Project, Run, Trace
from stepdoctor_server.deep import service as deep
from stepdoctor_server.jobs.claims import reset_to_pending
from stepdoctor_server.runs import service as runs
from stepdoctor_server.traces import service as traces
from stepdoctor_server.web.schemas import ErrorResponse, ReportJSON

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
    trace, _, _ = traces.load_trace(session, principal, trace_id)
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
    run, _ = runs.load_run(session, principal, run_id)
    ids = list(session.scalars(select(Trace.id).where(Trace.run_id == run.id).order_by(Trace.id)))
    reset_to_pending(session, ids)
    return Requeued(ids=ids)


@router.get(
    "/traces/{trace_id}/report",
    response_model=ReportOut,
    responses=_ERRORS,
    summary="The trace's report; one from an older engine is returned marked stale (the workers redo it)",
)
def get_report(trace_id: int, principal: ReadTeam, session: SessionDep) -> ReportOut:
    trace, _, _ = traces.load_trace(session, principal, trace_id)
    shown = traces.trace_report(session, trace)
    analysis, stale = shown.analysis, shown.stale
    return ReportOut(
        trace_id=trace.id,
        status=trace.status,
        status_reason=trace.status_reason,
        stale=stale,
        report=traces.public_report(analysis.report, trace.filename) if analysis is not None else None,
    )


class RunDiagnosisOut(BaseModel):
    run_id: int
    stale: bool = Field(
        description="true while the diagnosis or a trace's report comes from an older engine (the workers redo it)"
    )
    trace_status: dict[str, int]
    diagnosis: dict[str, Any] | None


@router.get(
    "/runs/{run_id}/diagnosis",
    response_model=RunDiagnosisOut,
    responses=_ERRORS,
    summary="The run's diagnosis, marked stale while reports from an older engine are redone",
)
def get_run_diagnosis(run_id: int, principal: ReadTeam, session: SessionDep) -> RunDiagnosisOut:
    run, _ = runs.load_run(session, principal, run_id)
    state = runs.run_state(session, run)
    return RunDiagnosisOut(
        run_id=run.id,
        stale=state.stale,
        trace_status=state.trace_status,
        diagnosis=msgspec.to_builtins(state.verdict) if state.verdict is not None else None,
    )


@router.get(
    "/compare",
    response_model=CompareOut,
    responses=_ERRORS,
    summary="Compare two runs: step times on a stated basis (`comparison.step.basis`: the unprofiled steady "
    "state when both runs have a step series, else profiled), per-category deltas, speedup, findings",
)
def compare_runs(
    principal: ReadTeam,
    session: SessionDep,
    base: int = Query(description="id of the baseline run"),
    other: int = Query(description="id of the run compared with it"),
) -> CompareOut:
    c = runs.compare_runs(
        session, runs.load_run(session, principal, base), runs.load_run(session, principal, other)
    )
    return CompareOut(
        base=_compared(c.base, c.base_project, c.base_diagnosis),
        other=_compared(c.other, c.other_project, c.other_diagnosis),
        comparison=c.comparison,
    )


def _compared(run: Run, project: Project, diagnosis: RunVerdict) -> dict[str, Any]:
    return {
        "id": run.id,
        "project": project.name,
        "name": run.name,
        "diagnosis": msgspec.to_builtins(diagnosis),
    }


@router.get(
    "/runs/{run_id}/tensorboard.zip",
    response_class=StreamingResponse,
    responses={200: {"description": "a zipped TensorBoard log directory"}, **_ERRORS},
    summary="The run's traces as a TensorBoard profiler log directory (unzip, tensorboard --logdir DIR)",
)
def tensorboard_zip(run_id: int, request: Request, principal: ReadTeam, session: SessionDep) -> Any:
    return runs.tensorboard_zip(session, principal, request.app.state.store, run_id)


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
    job, queued = deep.request_critical_path(session, principal, trace_id, step=step, force=force)
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
    trace, _, _ = traces.load_trace(session, principal, trace_id)
    return [deep_out(job) for job in deep.deep_analyses(session, trace.id)]
