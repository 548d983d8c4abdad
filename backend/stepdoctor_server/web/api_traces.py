"""Trace upload, status/report and download.

The upload is the one async endpoint: it validates everything it can before touching the body,
streams the body to a temp file (hashing, counting, inspecting), and only then opens a database
unit of work in the threadpool, renames the file into the store and lets the session dependency
commit. Any failure on the way leaves neither a row nor a file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from sqlalchemy import distinct, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from stepdoctor_server.auth.tokens import Principal, ReadTeam, UploadTeam
from stepdoctor_server.core.database import Database, SessionDep, on_rollback
from stepdoctor_server.core.errors import ApiError
from stepdoctor_server.core.models import Analysis, Project, Run, Trace
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.jobs.claims import enqueue_analyses
from stepdoctor_server.runs.service import get_or_create_project, get_or_create_run
from stepdoctor_server.traces import service as traces
from stepdoctor_server.traces.ingest import (
    BodyInspector,
    UploadMetadata,
    check_content_type,
    check_rank,
    parse_metadata,
    validate_idempotency_key,
    validate_name,
)
from stepdoctor_server.traces.snapshots import snapshot_of
from stepdoctor_server.traces.storage import StagedFile, TraceStore
from stepdoctor_server.web.api_catalog import trace_summary
from stepdoctor_server.web.schemas import AnalysisOut, ErrorResponse, TraceOut, UploadResult
from stepdoctor_server.web.uploads import check_declared_length

router = APIRouter(prefix="/api/v1/traces", tags=["traces"])

_ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 413, 415, 422)
}


@dataclass(frozen=True)
class UploadRequest:
    """Everything about an upload except its body, validated before the body is read."""

    project: str
    run: str
    rank: int | None
    idempotency_key: str | None
    metadata: UploadMetadata
    gzipped: bool | None


@router.post(
    "",
    status_code=201,
    response_model=UploadResult,
    responses={200: {"model": UploadResult, "description": "replay of a known Idempotency-Key"}, **_ERRORS},
    summary="Upload one rank's Chrome trace (gzip or plain JSON) as the raw request body",
)
async def upload_trace(
    request: Request,
    principal: UploadTeam,
    session: SessionDep,
    project: Annotated[str | None, Query(description="project name, created on first upload")] = None,
    run: Annotated[str | None, Query(description="run name, created on first upload")] = None,
    rank: Annotated[int | None, Query(ge=0, lt=2**31)] = None,
    metadata: Annotated[str | None, Query(description="run metadata JSON (or the header)")] = None,
    content_type: Annotated[str | None, Header()] = None,
    content_encoding: Annotated[str | None, Header()] = None,
    content_length: Annotated[str | None, Header()] = None,
    idempotency_key: Annotated[str | None, Header()] = None,
    x_stepdoctor_metadata: Annotated[str | None, Header()] = None,
) -> Response:
    settings: Settings = request.app.state.settings
    store: TraceStore = request.app.state.store
    upload = UploadRequest(
        project=validate_name("project", project),
        run=validate_name("run", run),
        rank=rank,
        idempotency_key=validate_idempotency_key(idempotency_key),
        metadata=parse_metadata(
            x_stepdoctor_metadata if x_stepdoctor_metadata is not None else metadata,
            max_bytes=settings.max_metadata_bytes,
        ),
        gzipped=check_content_type(content_type, content_encoding),
    )
    check_declared_length(content_length, settings.max_upload_bytes)
    if upload.idempotency_key is not None:
        known = await anyio.to_thread.run_sync(_find_replay_now, request, principal, upload.idempotency_key)
        if known is not None:
            # A replay must be the same request: same target now, same bytes once they are read.
            _check_same_target(known, upload)
            staged = await store.receive(request.stream(), max_bytes=settings.max_upload_bytes)
            store.discard(staged)
            _check_same_body(known, staged.sha256)
            return _upload_response(known.trace, replay=True)

    inspector = BodyInspector(gzipped=upload.gzipped, max_decompressed_bytes=settings.max_decompressed_bytes)
    staged = await store.receive(
        request.stream(), max_bytes=settings.max_upload_bytes, inspect=inspector.feed
    )
    try:
        await anyio.to_thread.run_sync(inspector.finish)
        _check_rank_in_world(upload, inspector)
        trace, replay = await anyio.to_thread.run_sync(
            _record_upload, session, store, principal, upload, staged, bool(inspector.gzipped), settings
        )
    finally:
        store.discard(staged)  # no-op once renamed into the store
    return _upload_response(trace, replay=replay)


def _check_rank_in_world(upload: UploadRequest, inspector: BodyInspector) -> None:
    """The upload's rank (else the trace's) within ``[0, world size)`` (the metadata's, else the trace's)."""
    trace_rank, trace_world = inspector.distributed()
    rank = upload.rank if upload.rank is not None else upload.metadata.rank
    world: int | None = upload.metadata.world_size
    source = "the upload's metadata.world_size"
    if world is None:
        world, source = trace_world, "the trace's distributedInfo.world_size"
    check_rank(rank if rank is not None else trace_rank, world, source=source)


def check_run_limits(session: Session, run_id: int, rank: int | None, settings: Settings) -> None:
    """409 when the run already holds the most traces, ranks, or windows of this rank it accepts
    (``STEPDOCTOR_MAX_RUN_RANKS``, ``STEPDOCTOR_MAX_RUN_WINDOWS``). Checked as the trace row is
    inserted: uploads in flight at once may pass together, by at most their number."""
    ranks, windows = settings.max_run_ranks, settings.max_run_windows
    in_run = select(func.count()).select_from(Trace).where(Trace.run_id == run_id)
    total = session.scalar(in_run) or 0
    if total >= ranks * windows:
        raise ApiError(
            409,
            "run_trace_limit",
            f"this run already holds {total} traces, the most a run accepts: STEPDOCTOR_MAX_RUN_RANKS={ranks} "
            f"ranks × STEPDOCTOR_MAX_RUN_WINDOWS={windows} windows",
        )
    if rank is None:
        return
    mine = session.scalar(in_run.where(Trace.rank == rank)) or 0
    if mine >= windows:
        raise ApiError(
            409,
            "run_window_limit",
            f"rank {rank} of this run already has {mine} traces (capture windows), the most a rank may "
            f"have: STEPDOCTOR_MAX_RUN_WINDOWS={windows}",
        )
    if mine == 0:
        known = select(func.count(distinct(Trace.rank))).where(
            Trace.run_id == run_id, Trace.rank.is_not(None)
        )
        if (count := session.scalar(known) or 0) >= ranks:
            raise ApiError(
                409,
                "run_rank_limit",
                f"this run already has {count} ranks, the most a run accepts: STEPDOCTOR_MAX_RUN_RANKS={ranks}",
            )


def _upload_response(trace: Trace, *, replay: bool) -> JSONResponse:
    body = UploadResult(id=trace.id, run_id=trace.run_id, status=trace.status)
    return JSONResponse(body.model_dump(), status_code=200 if replay else 201)


@dataclass(frozen=True)
class Replay:
    """The trace an Idempotency-Key already names, with the target it was uploaded to."""

    trace: Trace
    project: str
    run: str


def _find_replay_now(request: Request, principal: Principal, key: str) -> Replay | None:
    """Replay check in its own short transaction: the request session must stay idle while the
    body streams in (on SQLite an open transaction holds the write lock)."""
    db: Database = request.app.state.db
    with db.session() as session:
        return _find_replay(session, principal, key)


def _find_replay(session: Session, principal: Principal, key: str) -> Replay | None:
    row = session.execute(
        select(Trace, Project.name, Run.name)
        .join(Run, Run.id == Trace.run_id)
        .join(Project, Project.id == Run.project_id)
        .where(Trace.team_id == principal.team_id, Trace.idempotency_key == key)
    ).first()
    return None if row is None else Replay(trace=row[0], project=row[1], run=row[2])


def _idempotency_conflict(what: str) -> ApiError:
    return ApiError(
        422,
        "idempotency_key_reused",
        f"this Idempotency-Key was already used with a different {what}; use a new key for a new upload",
    )


def _check_same_target(known: Replay, upload: UploadRequest) -> None:
    rank = upload.rank if upload.rank is not None else upload.metadata.rank
    if (known.project, known.run, known.trace.rank) != (upload.project, upload.run, rank):
        raise _idempotency_conflict("project, run or rank")


def _check_same_body(known: Replay, sha256: str) -> None:
    if known.trace.sha256 != sha256:
        raise _idempotency_conflict("body (sha256 differs)")


def _replay(session: Session, principal: Principal, upload: UploadRequest, sha256: str) -> Trace | None:
    """The known trace if this request replays it exactly; 422 if the key names another request."""
    if upload.idempotency_key is None:
        return None
    known = _find_replay(session, principal, upload.idempotency_key)
    if known is None:
        return None
    _check_same_target(known, upload)
    _check_same_body(known, sha256)
    return known.trace


def _record_upload(
    session: Session,
    store: TraceStore,
    principal: Principal,
    upload: UploadRequest,
    staged: StagedFile,
    gzipped: bool,
    settings: Settings,
) -> tuple[Trace, bool]:
    """Insert the trace row (creating project and run on first use), then move the file in.

    Services only flush; the request's unit of work commits, and deletes the moved file again
    if that commit fails. Returns the trace and whether it was a replay of a known key.
    """
    known = _replay(session, principal, upload, staged.sha256)
    if known is not None:
        return known, True
    project = get_or_create_project(session, principal.team_id, upload.project)
    run = get_or_create_run(session, project, upload.run)
    if upload.metadata.tags:
        merged = list(run.tags or []) + [t for t in upload.metadata.tags if t not in (run.tags or [])]
        if merged != run.tags:
            run.tags = merged
    meta = upload.metadata
    rank = upload.rank if upload.rank is not None else meta.rank
    check_run_limits(session, run.id, rank, settings)
    trace = Trace(
        team_id=principal.team_id,
        run_id=run.id,
        rank=rank,
        window_index=meta.window_index,
        first_step=meta.first_step,
        last_step=meta.last_step,
        size_bytes=staged.size_bytes,
        sha256=staged.sha256,
        storage_key=TraceStore.new_key(principal.team_id, ".json.gz" if gzipped else ".json"),
        filename="pending",
        idempotency_key=upload.idempotency_key,
        meta=meta.raw,
        status="pending",
        attempts=0,
    )
    try:
        with session.begin_nested():
            session.add(trace)
            session.flush()
    except IntegrityError:
        # A concurrent request with the same Idempotency-Key won the race.
        known = _replay(session, principal, upload, staged.sha256)
        if known is None:
            raise
        return known, True
    trace.filename = download_filename(upload.project, upload.run, rank, trace.id, gzipped)
    session.flush()
    store.commit(staged, trace.storage_key)
    key = trace.storage_key
    on_rollback(session, lambda: store.delete(key))
    enqueue_analyses(session, [trace.id])  # the job commits with the trace row, or neither does
    return trace, False


def download_filename(project: str, run: str, rank: int | None, trace_id: int, gzipped: bool) -> str:
    """A name Chrome's trace viewer, Perfetto and TensorBoard recognise (``*.pt.trace.json[.gz]``)."""
    rank_part = f"_rank{rank}" if rank is not None else ""
    return f"{project}_{run}{rank_part}_{trace_id}.pt.trace.json{'.gz' if gzipped else ''}"


# -- reading -------------------------------------------------------------------------------------


@router.get("/{trace_id}", response_model=TraceOut, responses=_ERRORS, summary="Trace status and report")
def get_trace(trace_id: int, principal: ReadTeam, session: SessionDep) -> TraceOut:
    trace, run, project = traces.load_trace(session, principal, trace_id)
    # A report from an older engine is still shown, flagged stale, while it is redone.
    shown = traces.trace_report(session, trace)
    analysis, stale = shown.analysis, shown.stale
    summary = trace_summary(
        trace, analysis.primary_kind if analysis else None, analysis.primary_share if analysis else None
    )
    return TraceOut(
        **summary.model_dump(),
        project=project.name,
        run=run.name,
        metadata=trace.meta,
        download_url=f"/api/v1/traces/{trace.id}/download",
        analysis=_analysis_out(analysis, trace.filename) if analysis is not None else None,
        stale=stale,
        memory_snapshot_url=f"/api/v1/traces/{trace.id}/memory-snapshot"
        if snapshot_of(session, trace.id) is not None
        else None,
    )


def _analysis_out(analysis: Analysis, filename: str) -> AnalysisOut:
    out = AnalysisOut.model_validate(analysis)
    out.report = traces.public_report(out.report, filename)
    return out


@router.get(
    "/{trace_id}/download",
    response_class=FileResponse,
    responses={200: {"description": "the original uploaded bytes"}, **_ERRORS},
    summary="Download the trace as uploaded (open it in Perfetto or chrome://tracing)",
)
def download_trace(
    trace_id: int,
    request: Request,
    principal: ReadTeam,
    session: SessionDep,
    steps: Annotated[
        str | None,
        Query(max_length=32, description="only these ProfilerSteps, e.g. 5 or 5-6 (a smaller trace)"),
    ] = None,
) -> Response:
    return traces.download(session, principal, request.app.state.store, trace_id, request, steps=steps)
