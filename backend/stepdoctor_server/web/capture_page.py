"""The run page's "Capture now" button: the API's service (``runs.capture.request_capture``) with the
page's cookie principal, then back to the run page, which shows the request's state.

The form is a plain same-origin POST: the session cookie is ``SameSite=Strict`` and
``SameOriginMiddleware`` refuses a cookie-borne POST from another origin (the dashboard's CSRF
defence, as for the critical-path button).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from stepdoctor_server.core.database import DatabaseDep
from stepdoctor_server.runs import capture
from stepdoctor_server.web.pages import Viewer

router = APIRouter(include_in_schema=False)


@router.post("/runs/{run_id}/capture")
async def capture_now(run_id: int, viewer: Viewer, db: DatabaseDep) -> Response:
    """Record the request (or find the pending one) and show it on the run page; a second click while
    one is pending lands on ``?capture=pending``, which says so."""

    def record() -> bool:  # blocking database work: off the event loop
        with db.session() as session:
            return capture.request_capture(session, viewer, run_id)[1]

    created = await run_in_threadpool(record)
    query = "" if created else "?capture=pending"
    return RedirectResponse(f"/runs/{run_id}{query}#capture", status_code=303)
