"""Regressions over HTTP: a run as ``stepdoctor check --server`` compares it, and a project's baseline.

``GET .../check`` serves the same :class:`~stepdoctor_analysis.run.timeline.Side` the CLI builds
for a local run (``regressions.run_side``), so ``check`` compares server and local runs alike.
Choosing a baseline is a write (upload or admin scope) that redoes the project's statuses at once;
reading a status never computes one (the run-diagnosis job stores it on the run).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from fastapi import APIRouter
from pydantic import BaseModel, Field

from stepdoctor_server.auth.tokens import ReadTeam, UploadTeam
from stepdoctor_server.core.database import SessionDep
from stepdoctor_server.core.errors import ApiError
from stepdoctor_server.runs import regressions
from stepdoctor_server.runs import service as runs
from stepdoctor_server.web.schemas import ErrorResponse

router = APIRouter(prefix="/api/v1", tags=["regressions"])

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (401, 403, 404, 422)}


class CheckSideOut(BaseModel):
    """A run as ``stepdoctor check`` compares it (the engine's ``run_timeline.Side``, plus ids)."""

    source: str = Field(description="project/run")
    unprofiled_median_ms: float | None = Field(
        description="steady-state median step time outside capture windows, over every step of the series"
    )
    profiled_ms: float | None = Field(description="step time of the run's analysed traces (capture windows)")
    verdict: str | None = Field(description="the run diagnosis's primary bottleneck kind")
    steps: int | None = Field(description="steps in the run's step series")
    run_id: int
    finished: bool = Field(description="no trace waits for analysis and the series (if any) ended cleanly")


class BaselineIn(BaseModel):
    run_id: int | None = Field(
        description="the run to compare the project's runs with; null: the median of recent runs"
    )


class BaselineOut(BaseModel):
    project_id: int
    kind: Literal["chosen", "median"]
    run_id: int | None
    run_name: str | None
    recomputed: list[int] = Field(default_factory=list, description="runs whose regression status was redone")


@router.get(
    "/projects/{project}/runs/{run}/check",
    response_model=CheckSideOut,
    responses=_ERRORS,
    summary="A run by name as `stepdoctor check --server` compares it: steady step times and verdict",
)
def check_side(project: str, run: str, principal: ReadTeam, session: SessionDep) -> CheckSideOut:
    found, owner = regressions.load_named_run(session, principal, project, run)
    side, finished = regressions.run_side(session, found, owner)
    return CheckSideOut(**msgspec.to_builtins(side), run_id=found.id, finished=finished)


@router.get(
    "/projects/{project_id}/baseline",
    response_model=BaselineOut,
    responses=_ERRORS,
    summary="The project's baseline: a chosen run, or the median of its recent finished runs",
)
def get_baseline(project_id: int, principal: ReadTeam, session: SessionDep) -> BaselineOut:
    project = regressions.load_project(session, principal, project_id)
    return _baseline_out(session, project.id)


@router.put(
    "/projects/{project_id}/baseline",
    response_model=BaselineOut,
    responses=_ERRORS,
    summary="Choose the project's baseline run (null: back to the median of recent runs); upload or admin token",
)
def put_baseline(
    project_id: int, principal: UploadTeam, session: SessionDep, body: BaselineIn | None = None
) -> BaselineOut:
    project = regressions.load_project(session, principal, project_id)  # a bad id is 404 before the body
    if body is None:
        raise ApiError(422, "invalid_request", 'body: send {"run_id": N} or {"run_id": null}')
    run = runs.load_run(session, principal, body.run_id)[0] if body.run_id is not None else None
    redone = regressions.set_baseline(session, principal, project, run)
    return _baseline_out(session, project.id).model_copy(update={"recomputed": redone})


def _baseline_out(session: Any, project_id: int) -> BaselineOut:
    chosen = regressions.chosen_baseline(session, project_id)
    return BaselineOut(
        project_id=project_id,
        kind="chosen" if chosen is not None else "median",
        run_id=chosen.id if chosen is not None else None,
        run_name=chosen.name if chosen is not None else None,
    )
