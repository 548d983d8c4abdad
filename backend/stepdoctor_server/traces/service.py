"""Traces: the caller's trace, its analysis and report (flagged when stale), and its bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from stepdoctor_analysis.report.contract import ReportDoc
from stepdoctor_server.auth.tokens import Principal
from stepdoctor_server.core.errors import ApiError, check_id, not_found
from stepdoctor_server.core.models import Analysis, Project, Run, Trace
from stepdoctor_server.traces.reports import read_analysis
from stepdoctor_server.traces.storage import TraceStore


def load_trace(session: Session, principal: Principal, trace_id: int) -> tuple[Trace, Run, Project]:
    """The trace with its run and project, if it belongs to the caller's team (else 404)."""
    check_id("trace", trace_id)
    row = session.execute(
        select(Trace, Run, Project)
        .join(Run, Run.id == Trace.run_id)
        .join(Project, Project.id == Run.project_id)
        .where(Trace.id == trace_id, Project.team_id == principal.team_id)
    ).first()
    if row is None:
        raise not_found("trace", trace_id)
    trace, run, project = row
    return trace, run, project


@dataclass(frozen=True)
class TraceReport:
    """This trace's report: the stored analysis (the API returns its JSON as stored), the report
    typed (None before its analysis or when it does not decode) and whether it is stale."""

    analysis: Analysis | None
    doc: ReportDoc | None
    stale: bool


def trace_report(session: Session, trace: Trace) -> TraceReport:
    """The one answer to "this trace's report" for ``GET /traces/{id}``, ``GET .../report`` and the
    trace page (``reports.read_analysis``). Reading writes nothing: a stale report is redone by the
    workers' sweep (``runs.diagnosis_job.requeue_outdated``) or an explicit re-analysis."""
    analysis = session.scalar(select(Analysis).where(Analysis.trace_id == trace.id))
    if analysis is None:
        return TraceReport(None, None, False)
    doc, stale = read_analysis(analysis.report, analysis.engine_version, analysis.schema_version)
    return TraceReport(analysis, doc, stale)


def public_report(report: dict[str, Any], filename: str) -> dict[str, Any]:
    """The report as clients see it: ``source`` is the trace's file name, never a server path
    (reports stored before the worker wrote the name carry the storage path)."""
    if "source" in report and report["source"] != filename:
        report = {**report, "source": filename}
    return report


def download(
    session: Session,
    principal: Principal,
    store: TraceStore,
    trace_id: int,
    request: Request,
    *,
    steps: str | None = None,
) -> Response:
    """The trace as uploaded, or only the ProfilerSteps ``steps`` names (e.g. ``5-6``); 410 when the
    store lost the file."""
    from stepdoctor_server.traces.trim import check_steps_in_report, requested_steps, trimmed_download

    wanted = requested_steps(steps) if steps is not None else None  # a bad range fetches nothing
    trace, _, _ = load_trace(session, principal, trace_id)
    if wanted is not None:  # nor does a range the stored report shows the trace lacks
        check_steps_in_report(trace, trace_report(session, trace).doc, wanted)
    if not store.exists(trace.storage_key):
        raise ApiError(410, "gone", f"trace {trace_id} file is missing from the store")
    if wanted is not None:
        with store.local_copy(trace.storage_key) as path:
            return trimmed_download(trace, path, wanted, request)
    media = "application/gzip" if trace.filename.endswith(".gz") else "application/json"
    # The local store sends the file; S3 streams it through (or redirects to a presigned URL).
    return store.download(
        trace.storage_key,
        filename=trace.filename,
        media_type=media,
        headers={"X-Content-SHA256": trace.sha256, "Cache-Control": "private, max-age=3600"},
    )
