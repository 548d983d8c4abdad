"""Step-series upload: one chunk of the agent's step series per request (``stepdoctor.series``).

Routed like a trace (``?project=&run=``, an upload token, project and run created on first use).
The body is the chunk's bytes as the agent wrote them; it is read whole (bounded by
``max_series_chunk_bytes``: 413 past it), validated by the engine's reader and stored in one unit
of work (``runs.series.store_chunk``), so a refused chunk leaves nothing behind. Sending a stored
chunk again answers 200 with the same result (the agent retries after a lost answer).
"""

from __future__ import annotations

from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.orm import Session

from stepdoctor_server.auth.tokens import Principal, UploadTeam
from stepdoctor_server.core.database import SessionDep
from stepdoctor_server.core.errors import ApiError
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.runs import series
from stepdoctor_server.runs.service import get_or_create_project, get_or_create_run
from stepdoctor_server.traces.ingest import validate_name
from stepdoctor_server.web.schemas import ErrorResponse
from stepdoctor_server.web.uploads import check_declared_length, read_bounded

router = APIRouter(prefix="/api/v1/series", tags=["series"])

_ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 413, 422)
}


class SeriesUploadResult(BaseModel):
    run_id: int
    stream: str
    seq: int
    first_step: int
    last_step: int
    replay: bool


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413,
        "payload_too_large",
        f"series chunk exceeds the size limit of {max_bytes} bytes (STEPDOCTOR_MAX_SERIES_CHUNK_BYTES)",
    )


@router.post(
    "",
    status_code=201,
    response_model=SeriesUploadResult,
    responses={200: {"model": SeriesUploadResult, "description": "the chunk was already stored"}, **_ERRORS},
    summary="Upload one chunk of a run's step series (the agent's SDSERIES bytes) as the raw request body",
)
async def upload_series_chunk(
    request: Request,
    principal: UploadTeam,
    session: SessionDep,
    project: Annotated[str | None, Query(description="project name, created on first upload")] = None,
    run: Annotated[str | None, Query(description="run name, created on first upload")] = None,
    content_length: Annotated[str | None, Header()] = None,
) -> JSONResponse:
    settings: Settings = request.app.state.settings
    project_name, run_name = validate_name("project", project), validate_name("run", run)
    limit = settings.max_series_chunk_bytes
    check_declared_length(content_length, limit, _too_large(limit))
    body = await read_bounded(request, limit, _too_large(limit))
    stored = await anyio.to_thread.run_sync(_record, session, principal, project_name, run_name, body)
    result = SeriesUploadResult(
        run_id=stored.run_id,
        stream=stored.stream,
        seq=stored.seq,
        first_step=stored.first_step,
        last_step=stored.last_step,
        replay=stored.replay,
    )
    return JSONResponse(result.model_dump(), status_code=200 if stored.replay else 201)


def _record(session: Session, principal: Principal, project: str, run: str, data: bytes) -> series.Stored:
    # Validated before the project and run exist: a bad chunk creates neither.
    chunk = series.check_chunk(data)
    owner = get_or_create_project(session, principal.team_id, project)
    target = get_or_create_run(session, owner, run)
    return series.store_chunk(session, target, data, chunk=chunk)
