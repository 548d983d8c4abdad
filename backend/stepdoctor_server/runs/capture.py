"""Capture on demand: a live run's "Capture now" requests, which its agent polls for and acknowledges.

The dashboard (or the API) records a request; the run's agent asks for pending requests of its
project and run (``stepdoctor.on_demand``, at most every 30 s), captures the next window with
``capture.reason = "on_demand"`` and the request's id in its metadata, and acknowledges with that
window's Idempotency-Key. The captured trace is found by that key once its upload arrives (it may
arrive before or after the acknowledgement), so nothing here waits on the upload.

A run has at most one pending request (``CaptureRequest.pending_run_id`` is unique): asking again
while one is pending returns that one. Only a live run (``runs.series.liveness_of``) takes a request,
and only tokens that may upload (upload or admin scope) make one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from stepdoctor_server.auth.tokens import Principal
from stepdoctor_server.core.errors import ApiError, check_id, not_found
from stepdoctor_server.core.models import CaptureRequest, Project, Run, Trace, utcnow
from stepdoctor_server.runs.series import liveness_of
from stepdoctor_server.runs.service import load_run

#: Requests listed per run (API and page): the latest first.
RECENT = 20


@dataclass(frozen=True)
class CaptureState:
    """One request as the page and the API show it; ``trace_id`` once the captured trace arrived."""

    id: int
    run_id: int
    status: str  # pending | captured | failed
    requested_at: datetime
    acknowledged_at: datetime | None
    rank: int | None
    trace_id: int | None
    detail: str | None


@dataclass(frozen=True)
class CaptureView:
    """What the run page shows: whether "Capture now" is offered, and the latest request."""

    live: bool
    can_request: bool
    latest: CaptureState | None

    @property
    def waiting(self) -> bool:
        """A request is on its way (pending, or captured and its trace not here yet): the page reloads."""
        latest = self.latest
        if latest is None or not self.live:
            return False
        return latest.status == "pending" or (latest.status == "captured" and latest.trace_id is None)


def _state(session: Session, request: CaptureRequest) -> CaptureState:
    trace_id = None
    if request.trace_key is not None:
        trace_id = session.scalar(
            select(Trace.id).where(Trace.run_id == request.run_id, Trace.idempotency_key == request.trace_key)
        )
    return CaptureState(
        id=request.id,
        run_id=request.run_id,
        status=request.status,
        requested_at=request.requested_at,
        acknowledged_at=request.acknowledged_at,
        rank=request.rank,
        trace_id=trace_id,
        detail=request.detail,
    )


def recent_captures(session: Session, run_id: int, limit: int = RECENT) -> list[CaptureState]:
    """The run's latest requests, newest first."""
    rows = session.scalars(
        select(CaptureRequest)
        .where(CaptureRequest.run_id == run_id)
        .order_by(CaptureRequest.id.desc())
        .limit(limit)
    )
    return [_state(session, row) for row in rows]


def capture_view(session: Session, viewer: Principal, run: Run) -> CaptureView:
    """The run page's capture section: offered to viewers who may upload, while the run is live."""
    live = liveness_of(session, run.id) == "live"
    latest = recent_captures(session, run.id, 1)
    return CaptureView(
        live=live, can_request=live and viewer.allows("upload"), latest=latest[0] if latest else None
    )


def _pending(session: Session, run_id: int) -> CaptureRequest | None:
    return session.scalar(select(CaptureRequest).where(CaptureRequest.pending_run_id == run_id))


def request_capture(session: Session, principal: Principal, run_id: int) -> tuple[CaptureState, bool]:
    """Ask the run's agent for a capture: (the request, whether it is new). A pending request is
    returned as it is; 403 without upload rights, 404 for another team's run, 409 when the run is
    not live (no agent would hear it)."""
    if not principal.allows("upload"):
        raise ApiError(403, "forbidden", "requesting a capture needs an upload or admin token")
    run, _ = load_run(session, principal, run_id)
    known = _pending(session, run.id)
    if known is not None:
        return _state(session, known), False
    liveness = liveness_of(session, run.id)
    if liveness != "live":
        said = "has no step series from an agent" if liveness is None else f"is {liveness}"
        raise ApiError(409, "run_not_live", f"run {run.id} {said}: only a live run's agent can capture")
    row = CaptureRequest(
        run_id=run.id,
        pending_run_id=run.id,
        status="pending",
        requested_at=utcnow(),
        requested_by=principal.token_id,
    )
    try:
        with session.begin_nested():
            session.add(row)
            session.flush()
    except IntegrityError:  # another click won the race: one pending request per run
        known = _pending(session, run.id)
        if known is None:
            raise
        return _state(session, known), False
    return _state(session, row), True


def _team_run(session: Session, principal: Principal, project: str, run: str) -> int | None:
    return session.scalar(
        select(Run.id)
        .join(Project, Project.id == Run.project_id)
        .where(Project.team_id == principal.team_id, Project.name == project, Run.name == run)
    )


def pending_for(session: Session, principal: Principal, project: str, run: str) -> list[CaptureRequest]:
    """The pending request of the caller's run ``project/run`` (a list: empty when none, or when the
    run does not exist yet: an agent may poll before its first upload)."""
    run_id = _team_run(session, principal, project, run)
    if run_id is None:
        return []
    known = _pending(session, run_id)
    return [known] if known is not None else []


def load_request(session: Session, principal: Principal, request_id: int) -> CaptureRequest:
    """The capture request, if it belongs to the caller's team (else 404)."""
    check_id("capture request", request_id)
    row = session.execute(
        select(CaptureRequest)
        .join(Run, Run.id == CaptureRequest.run_id)
        .join(Project, Project.id == Run.project_id)
        .where(CaptureRequest.id == request_id, Project.team_id == principal.team_id)
    ).scalar()
    if row is None:
        raise not_found("capture request", request_id)
    return row


def acknowledge(
    session: Session,
    principal: Principal,
    request_id: int,
    *,
    trace_key: str | None,
    rank: int | None,
    detail: str | None,
) -> CaptureState:
    """The agent captured the request's window (``trace_key``: its upload's Idempotency-Key) or could
    not (``detail`` says why). Acknowledging an answered request again changes nothing (the agent
    retries when an answer is lost); 404 for another team's request."""
    row = load_request(session, principal, request_id)
    if row.status == "pending":
        row.status = "captured" if trace_key else "failed"
        row.pending_run_id = None
        row.acknowledged_at = utcnow()
        row.rank, row.trace_key, row.detail = rank, trace_key, detail
        session.flush()
    return _state(session, row)
