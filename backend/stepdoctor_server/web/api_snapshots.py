"""A trace's memory snapshot (``traces.snapshots``): upload, download, and the trace page's download link.

``POST /api/v1/traces/{id}/memory-snapshot`` takes the pickle as the raw body, streamed to a stage
file like a trace (its header checked on the first chunk), then checked whole off the event loop
without unpickling it, and recorded in the threadpool's unit of work. ``GET`` on the same path (and
``/traces/{id}/memory-snapshot`` for the dashboard's cookie) sends it back as an attachment.
"""

from __future__ import annotations

from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel

from stepdoctor_server.auth.tokens import ReadTeam, UploadTeam
from stepdoctor_server.core.database import SessionDep
from stepdoctor_server.core.errors import check_id
from stepdoctor_server.core.models import MemorySnapshot
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.traces import snapshots
from stepdoctor_server.traces.storage import TraceStore
from stepdoctor_server.web.api_traces import _ERRORS
from stepdoctor_server.web.pages import Viewer
from stepdoctor_server.web.uploads import check_declared_length

router = APIRouter(prefix="/api/v1/traces", tags=["traces"])
page_router = APIRouter(include_in_schema=False)


class SnapshotOut(BaseModel):
    trace_id: int
    size_bytes: int
    sha256: str
    protocol: int
    filename: str
    download_url: str
    viewer: str = snapshots.VIEWER


@router.post(
    "/{trace_id}/memory-snapshot",
    status_code=201,
    response_model=SnapshotOut,
    responses={
        200: {"model": SnapshotOut, "description": "the same snapshot, already stored"},
        409: {},
        **_ERRORS,
    },
    summary="Upload the trace's CUDA memory snapshot (torch.cuda.memory._snapshot() pickled; never unpickled)",
)
async def upload_snapshot(
    trace_id: int,
    request: Request,
    principal: UploadTeam,
    session: SessionDep,
    content_type: Annotated[str | None, Header()] = None,
    content_encoding: Annotated[str | None, Header()] = None,
    content_length: Annotated[str | None, Header()] = None,
) -> Response:
    check_id("trace", trace_id)
    settings: Settings = request.app.state.settings
    store: TraceStore = request.app.state.store
    snapshots.check_content_type(content_type, content_encoding)
    check_declared_length(content_length, settings.max_upload_bytes)
    staged = await store.receive(
        request.stream(), max_bytes=settings.max_upload_bytes, inspect=snapshots.HeaderCheck().feed
    )
    try:
        protocol = await anyio.to_thread.run_sync(snapshots.check_file, staged.temp_path)
        snapshot, replay = await anyio.to_thread.run_sync(
            snapshots.store_snapshot, session, store, principal, trace_id, staged, protocol
        )
        body = _out(snapshot.trace_id, snapshot)
    finally:
        store.discard(staged)  # no-op once moved into the store
    return JSONResponse(body.model_dump(), status_code=200 if replay else 201)


def _out(trace_id: int, snapshot: MemorySnapshot) -> SnapshotOut:
    return SnapshotOut(
        trace_id=trace_id,
        size_bytes=snapshot.size_bytes,
        sha256=snapshot.sha256,
        protocol=snapshot.protocol,
        filename=snapshot.filename,
        download_url=f"/api/v1/traces/{trace_id}/memory-snapshot",
    )


@router.get(
    "/{trace_id}/memory-snapshot",
    response_class=FileResponse,
    responses={
        200: {"description": "the snapshot as uploaded (application/octet-stream)"},
        410: {},
        **_ERRORS,
    },
    summary=f"Download the trace's memory snapshot (open it in {snapshots.VIEWER})",
)
def download_snapshot(trace_id: int, request: Request, principal: ReadTeam, session: SessionDep) -> Response:
    return snapshots.download_snapshot(session, principal, request.app.state.store, trace_id)


@page_router.get("/traces/{trace_id}/memory-snapshot")
def download_snapshot_page(trace_id: int, request: Request, viewer: Viewer, session: SessionDep) -> Response:
    """The trace page's link: the same download with the dashboard's cookie."""
    return snapshots.download_snapshot(session, viewer, request.app.state.store, trace_id)
