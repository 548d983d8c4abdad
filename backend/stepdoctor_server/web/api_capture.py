"""Capture on demand over HTTP (``runs.capture``): people ask a live run for a capture, its agent
polls for the request and acknowledges it.

- ``POST /api/v1/runs/{run_id}/capture-requests`` (upload or admin token; the dashboard's button
  calls the same service): 201 with a new request, 200 with the pending one, 409 when the run is
  not live.
- ``GET /api/v1/runs/{run_id}/capture-requests`` (read): the run's latest requests, with the
  captured trace once it arrived.
- ``GET /api/v1/capture-requests?project=&run=`` (upload: the agent's token): the pending request of
  that run, if any.
- ``POST /api/v1/capture-requests/{id}/ack`` (upload): the agent captured it (``trace_key``: the
  window's Idempotency-Key) or could not (``detail``).
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, model_validator

from stepdoctor_server.auth.tokens import ReadTeam, UploadTeam
from stepdoctor_server.core.database import SessionDep
from stepdoctor_server.core.errors import ApiError
from stepdoctor_server.runs import capture
from stepdoctor_server.runs.service import load_run
from stepdoctor_server.traces.ingest import validate_name
from stepdoctor_server.web.schemas import ErrorResponse

router = APIRouter(prefix="/api/v1", tags=["capture"])

_ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorResponse} for code in (401, 403, 404, 409, 422)
}


class CaptureOut(BaseModel):
    id: int
    run_id: int
    status: str = Field(description="pending, captured (the agent captured the window) or failed")
    requested_at: datetime
    acknowledged_at: datetime | None
    rank: int | None = Field(description="the rank whose agent acknowledged it")
    trace_id: int | None = Field(description="the captured trace, once its upload arrived")
    detail: str | None = Field(description="why the agent could not capture, when it failed")
    created: bool | None = Field(default=None, description="on a request: whether it is new")

    @classmethod
    def of(cls, state: capture.CaptureState, created: bool | None = None) -> CaptureOut:
        return cls(**asdict(state), created=created)


class CaptureList(BaseModel):
    items: list[CaptureOut]


class PendingCapture(BaseModel):
    id: int
    requested_at: datetime


class PendingList(BaseModel):
    requests: list[PendingCapture]


class CaptureAck(BaseModel):
    trace_key: str | None = Field(
        default=None, min_length=1, max_length=128, description="the captured window's Idempotency-Key"
    )
    rank: int | None = Field(default=None, ge=0, lt=2**31)
    detail: str | None = Field(
        default=None, min_length=1, max_length=500, description="why no window was captured"
    )

    @model_validator(mode="after")
    def _one_outcome(self) -> CaptureAck:
        if (self.trace_key is None) == (self.detail is None):
            raise ValueError("send either trace_key (captured) or detail (not captured)")
        return self


@router.post(
    "/runs/{run_id}/capture-requests",
    status_code=201,
    response_model=CaptureOut,
    responses={200: {"model": CaptureOut, "description": "a request was already pending"}, **_ERRORS},
    summary="Ask a live run's agent to capture its next window",
)
def request_capture(run_id: int, principal: UploadTeam, session: SessionDep) -> JSONResponse:
    state, created = capture.request_capture(session, principal, run_id)
    return JSONResponse(
        CaptureOut.of(state, created).model_dump(mode="json"), status_code=201 if created else 200
    )


@router.get(
    "/runs/{run_id}/capture-requests",
    response_model=CaptureList,
    responses=_ERRORS,
    summary="A run's latest capture requests, newest first",
)
def list_captures(run_id: int, principal: ReadTeam, session: SessionDep) -> CaptureList:
    run, _ = load_run(session, principal, run_id)
    return CaptureList(items=[CaptureOut.of(s) for s in capture.recent_captures(session, run.id)])


@router.get(
    "/capture-requests",
    response_model=PendingList,
    responses=_ERRORS,
    summary="The pending capture request of a run (the agent polls this)",
)
def pending_captures(
    principal: UploadTeam,
    session: SessionDep,
    project: Annotated[str | None, Query(description="project name")] = None,
    run: Annotated[str | None, Query(description="run name")] = None,
) -> PendingList:
    found = capture.pending_for(
        session, principal, validate_name("project", project), validate_name("run", run)
    )
    return PendingList(requests=[PendingCapture(id=r.id, requested_at=r.requested_at) for r in found])


@router.post(
    "/capture-requests/{request_id}/ack",
    response_model=CaptureOut,
    responses=_ERRORS,
    summary="The agent captured the requested window (or says why it could not)",
)
def acknowledge_capture(
    request_id: int, principal: UploadTeam, session: SessionDep, ack: CaptureAck | None = None
) -> CaptureOut:
    if ack is None:  # a bad or foreign id is 404 before the missing body is named
        capture.load_request(session, principal, request_id)
        raise ApiError(422, "invalid_request", 'body: send {"trace_key": "..."} or {"detail": "..."}')
    state = capture.acknowledge(
        session, principal, request_id, trace_key=ack.trace_key, rank=ack.rank, detail=ack.detail
    )
    return CaptureOut.of(state)
