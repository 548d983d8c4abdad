"""Runs: the caller's run, its stored diagnosis and trace counts, tag filters, its TensorBoard export, and
the dashboard's run lists, a run's traces and facts, and what two compared runs must share."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fastapi.responses import StreamingResponse
from sqlalchemy import ColumnElement, cast, exists, func, null, select
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from stepdoctor_analysis.run.verdict import RunVerdict
from stepdoctor_server.auth.tokens import Principal
from stepdoctor_server.core.database import get_or_create
from stepdoctor_server.core.errors import ApiError, check_id, not_found
from stepdoctor_server.core.models import Analysis, Project, Run, Trace
from stepdoctor_server.runs import compare, regressions
from stepdoctor_server.runs import export as tensorboard_export
from stepdoctor_server.runs.diagnosis import read_verdict, worker_of
from stepdoctor_server.runs.diagnosis_job import diagnosis_stale
from stepdoctor_server.traces.reports import ReportFacts, is_stale, read_facts
from stepdoctor_server.traces.storage import TraceStore


def load_run(session: Session, principal: Principal, run_id: int) -> tuple[Run, Project]:
    """The run and its project if they belong to the caller's team (else 404)."""
    check_id("run", run_id)
    row = session.execute(
        select(Run, Project)
        .join(Project, Project.id == Run.project_id)
        .where(Run.id == run_id, Project.team_id == principal.team_id)
    ).first()
    if row is None:
        raise not_found("run", run_id)
    run, project = row
    return run, project


def trace_status_counts(session: Session, run_id: int) -> dict[str, int]:
    """How many of the run's traces are in each status (absent statuses are left out)."""
    query = select(Trace.status, func.count(Trace.id)).where(Trace.run_id == run_id).group_by(Trace.status)
    return {str(status): int(n) for status, n in session.execute(query)}


def run_diagnosis(run: Run) -> RunVerdict:
    """This run's verdict as stored (the workers refresh it as its traces finish), typed; 409 while
    it has none, or while the stored one is stale (``diagnosis_job.diagnosis_stale``: the workers redo it).

    Reading it (rather than re-aggregating every report on the request path) keeps compare, the run
    page and ``GET /runs/{id}`` on one source of truth.
    """
    verdict = read_verdict(run.diagnosis)
    if run.diagnosis and (verdict is None or diagnosis_stale(run.diagnosis)):
        raise ApiError(
            409, "outdated", f"run {run.id}'s stored diagnosis is outdated; it is rebuilt by the workers"
        )
    if verdict is None or not verdict.traces:
        raise ApiError(409, "not_analyzed", f"run {run.id} has no analysed traces yet")
    return verdict


def run_state(session: Session, run: Run) -> RunState:
    """The run's verdict (None before any, or while stale), whether it or any of its traces' reports
    is stale, and its traces' states: what ``GET /runs/{id}/diagnosis`` and the run page show. Writes
    nothing."""
    rows = session.execute(
        select(Analysis.engine_version, Analysis.schema_version)
        .join(Trace, Trace.id == Analysis.trace_id)
        .where(Trace.run_id == run.id)
    ).all()
    stale_traces = sum(is_stale(e, v) for e, v in rows)
    verdict = read_verdict(run.diagnosis)
    stale = bool(stale_traces) or (run.diagnosis is not None and diagnosis_stale(run.diagnosis))
    return RunState(verdict=verdict, stale=stale, trace_status=trace_status_counts(session, run.id))


@dataclass(frozen=True)
class RunState:
    verdict: RunVerdict | None
    stale: bool
    trace_status: dict[str, int]


def has_tag(session: Session, tag: str) -> ColumnElement[bool]:
    """Tags are a JSON list; containment is dialect-specific (jsonb @> on PostgreSQL, json_each on SQLite)."""
    if session.get_bind().dialect.name == "postgresql":
        return cast(Run.tags, JSONB).contains([tag])
    each = func.json_each(Run.tags).table_valued("value")
    return exists(select(1).select_from(each).where(each.c.value == tag))


_HEADER_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def tensorboard_zip(
    session: Session, principal: Principal, store: TraceStore, run_id: int
) -> StreamingResponse:
    """The run's stored traces as a zipped TensorBoard profiler log directory; 409 when none is left."""
    run, project = load_run(session, principal, run_id)
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


def _host(meta: dict[str, Any] | None) -> str | None:
    host = (meta or {}).get("host") or (meta or {}).get("hostname")
    return str(host) if host else None


# -- the API's catalog (keyset-paginated by the router) ---------------------------------------------


def projects_query(principal: Principal) -> Any:
    """(project, run count) rows of the team."""
    run_count = select(func.count(Run.id)).where(Run.project_id == Project.id).scalar_subquery()
    return select(Project, run_count).where(Project.team_id == principal.team_id)


def catalog_query(
    session: Session,
    principal: Principal,
    *,
    project: str | None = None,
    tag: str | None = None,
    primary_kind: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> Any:
    """(run, project name, trace count) rows of the team, each filter applied when given (the
    caller validated them): project name, tag, primary kind, created in [since, until)."""
    trace_count = select(func.count(Trace.id)).where(Trace.run_id == Run.id).scalar_subquery()
    query = (
        select(Run, Project.name, trace_count)
        .join(Project, Project.id == Run.project_id)
        .where(Project.team_id == principal.team_id)
    )
    if project is not None:
        query = query.where(Project.name == project)
    if tag is not None:
        query = query.where(has_tag(session, tag))
    if primary_kind is not None:
        query = query.where(Run.primary_kind == primary_kind)
    if since is not None:
        query = query.where(Run.created_at >= since)
    if until is not None:
        query = query.where(Run.created_at < until)
    return query


def traces_query(run_id: int) -> Any:
    """(trace, primary kind, primary share) rows of the run."""
    return (
        select(Trace, Analysis.primary_kind, Analysis.primary_share)
        .outerjoin(Analysis, Analysis.trace_id == Trace.id)
        .where(Trace.run_id == run_id)
    )


# -- the dashboard's views: lists, a run's traces and facts, what two compared runs must share ------

# Run-list sorts: every one is served by an index (migration 2026_11_22_0014_dashboard_indexes).
RUN_SORTS: dict[str, tuple[Any, ...]] = {
    "updated": (Run.updated_at.desc(), Run.id.desc()),
    "created": (Run.created_at.desc(), Run.id.desc()),
    "name": (Run.name.asc(), Run.id.asc()),
    "bottleneck": (Run.primary_kind.asc(), Run.updated_at.desc(), Run.id.desc()),
}
PAGE_SIZE = 50


def team_projects(session: Session, principal: Principal) -> list[Any]:
    """The team's projects as (project, run count, last activity), most recently active first."""
    # Run count and last activity are both read from the (project_id, updated_at) index.
    projects = session.execute(
        select(Project, func.count(Run.id), func.max(Run.updated_at))
        .outerjoin(Run, Run.project_id == Project.id)
        .where(Project.team_id == principal.team_id)
        .group_by(Project.id)
        .order_by(Project.name)
    ).all()
    return sorted(projects, key=lambda row: (row[2] is None, -(row[2].timestamp() if row[2] else 0)))


def runs_query(
    principal: Principal, project_id: int | None, *, q: str = "", kind: str = "", sort: str = "updated"
) -> Any:
    """(run, project name) rows of the team, searched by name, filtered by primary kind ("pending":
    none yet), in one of ``RUN_SORTS``."""
    query = (
        select(Run, Project.name)
        .join(Project, Project.id == Run.project_id)
        .where(Project.team_id == principal.team_id)
        .order_by(*RUN_SORTS[sort])
    )
    if project_id is not None:
        query = query.where(Run.project_id == project_id)
    if q:
        query = query.where(Run.name.ilike(f"%{_like_escape(q)}%", escape="\\"))
    if kind == "pending":
        query = query.where(Run.primary_kind.is_(None))
    elif kind:
        query = query.where(Run.primary_kind == kind)
    return query


def recent_runs(session: Session, principal: Principal, limit: int) -> list[Any]:
    """The team's most recently updated runs, as (run, project name)."""
    return list(session.execute(runs_query(principal, None).limit(limit)).all())


def page_of_runs(
    session: Session,
    principal: Principal,
    project_id: int | None,
    *,
    q: str,
    kind: str,
    tag: str,
    sort: str,
    page: int,
) -> dict[str, Any]:
    """One numbered page of ``runs_query`` (``PAGE_SIZE`` rows), with the total and page count."""
    query = runs_query(principal, project_id, q=q, kind=kind, sort=sort)
    if tag:
        query = query.where(has_tag(session, tag))
    ids = query.with_only_columns(Run.id)
    total = int(session.scalar(select(func.count()).select_from(ids.order_by(None).subquery())) or 0)
    pages = max(1, math.ceil(total / PAGE_SIZE))
    page = min(page, pages)
    # The offset walks index entries (ids only); the page's rows, diagnosis JSON included, are then
    # read by primary key. Skipping whole rows made page 100 of 10k runs take half a second.
    page_ids = session.scalars(ids.offset((page - 1) * PAGE_SIZE).limit(PAGE_SIZE)).all()
    by_id = runs_query(principal, project_id, q=q, kind=kind, sort=sort).where(Run.id.in_(page_ids))
    rows = session.execute(by_id).all() if page_ids else []
    return {
        "runs": rows,
        "total": total,
        "page": page,
        "pages": pages,
        "first_index": (page - 1) * PAGE_SIZE + 1 if rows else 0,
    }


def _like_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def run_traces(session: Session, run_id: int, limit: int) -> tuple[list[Any], int]:
    """The run's first ``limit`` traces as (trace, primary kind, report steps) by rank and window,
    and how many it has in all.

    The steps are read after the limit, for the listed traces without step numbers of their own:
    PostgreSQL evaluates a select list before its sort and limit, and each report's JSON field is a
    parse of the whole report (``json``, not ``jsonb``), so reading them in the sorted query parsed
    every report of the run (328 ms at 128 ranks for 10 rows listed)."""
    rows = session.execute(
        select(Trace, Analysis.primary_kind)
        .outerjoin(Analysis, Analysis.trace_id == Trace.id)
        .where(Trace.run_id == run_id)
        .order_by(Trace.rank, Trace.window_index, Trace.id)
        .limit(limit)
    ).all()
    unnumbered = [t.id for t, _ in rows if t.first_step is None]
    steps: dict[int, Any] = dict(
        session.execute(
            select(Analysis.trace_id, Analysis.report["steps"].as_json()).where(
                Analysis.trace_id.in_(unnumbered)
            )
        ).all()
        if unnumbered
        else []
    )
    count = int(session.scalar(select(func.count(Trace.id)).where(Trace.run_id == run_id)) or 0)
    return [(t, kind, steps.get(t.id)) for t, kind in rows], count


def rank_places(session: Session, run_id: int) -> dict[int | str, tuple[int, str | None]]:
    """Each rank's first trace (its lowest window) and host, keyed as the engine groups ranks
    (``ranks.rank_of``: the upload's rank, else the report's, else the agent's ``host_pid``): where a
    click on a rank of the run page goes. Columns first; a report's rank is read only for traces
    uploaded without one (on PostgreSQL a report's JSON field costs a parse of the whole report)."""
    rows = session.execute(
        select(Trace.id, Trace.rank, Trace.meta)
        .where(Trace.run_id == run_id)
        .order_by(Trace.window_index.desc(), Trace.id.desc())
    ).all()
    unranked = [int(t) for t, rank, _ in rows if rank is None]
    report_ranks: dict[int, Any] = dict(
        session.execute(
            select(Analysis.trace_id, Analysis.report["rank"].as_json()).where(
                Analysis.trace_id.in_(unranked)
            )
        ).all()
        if unranked
        else []
    )
    out: dict[int | str, tuple[int, str | None]] = {}
    for trace_id, rank, meta in rows:  # the last written is the first window
        report_rank = report_ranks.get(trace_id)
        key = rank if rank is not None else report_rank if isinstance(report_rank, int) else worker_of(meta)
        if key is not None:
            out[key] = (int(trace_id), _host(meta))
    return out


def sibling_runs(session: Session, run: Run, limit: int) -> list[Any]:
    """(id, name) of the other runs of the run's project, most recently updated first."""
    return list(
        session.execute(
            select(Run.id, Run.name)
            .where(Run.project_id == run.project_id, Run.id != run.id)
            .order_by(Run.updated_at.desc())
            .limit(limit)
        ).all()
    )


def run_facts(
    session: Session,
    run_id: int,
    *,
    first: Sequence[int] = (),
    limit: int | None = None,
    slowest: bool = True,
) -> tuple[int | None, list[str], int]:
    """The trace whose report stands for the run in the facts (its slowest analysed one), the
    traces' analysis warnings, deduplicated, and how many traces were read; read as JSON fields,
    not whole reports.

    ``limit``: read at most this many traces, ``first`` (e.g. the lead trace and the stragglers')
    before the others by id. On PostgreSQL each report's JSON field costs a parse of the whole report
    (the column is ``json``): every trace of a 1,000-rank run took seconds, most of its page's time.
    ``slowest=False``: the caller knows the trace that stands for the run; no step time is read
    (None is returned for it).
    """
    step = Analysis.report["step_time_us"].as_float() if slowest else null()
    query = (
        select(Analysis.trace_id, step, Analysis.report["warnings"])
        .join(Trace, Trace.id == Analysis.trace_id)
        .where(Trace.run_id == run_id)
    )
    if limit is not None:
        ids = list(dict.fromkeys(first))[:limit]
        ids += session.scalars(
            select(Analysis.trace_id)
            .join(Trace, Trace.id == Analysis.trace_id)
            .where(Trace.run_id == run_id, Analysis.trace_id.not_in(ids))
            .order_by(Analysis.trace_id)
            .limit(max(0, limit - len(ids)))
        ).all()
        query = query.where(Analysis.trace_id.in_(ids))
    rows = session.execute(query).all()
    if not rows:
        return None, [], 0
    slow = max(rows, key=lambda r: (r[1] or 0.0, -r[0]))[0] if slowest else None
    warnings: list[str] = []
    for _, _, ws in rows:
        for w in ws or []:
            if isinstance(w, str) and w not in warnings:
                warnings.append(w)
    return slow, warnings, len(rows)


def facts_report(session: Session, trace_id: int) -> ReportFacts | None:
    """The parts of a report the run page shows (device, GPU and memory metrics, tables), read as
    JSON fields and typed (``reports.read_facts``; None before the analysis or when outdated): the
    whole report also holds the drawn steps, which only the trace page needs."""
    metrics = Analysis.report["metrics"]
    row = session.execute(
        select(
            Analysis.report["device"],
            metrics["gpu"],
            metrics["memory"]["devices"],
            Analysis.report["tables"],
        ).where(Analysis.trace_id == trace_id)
    ).first()
    if row is None:
        return None
    device, gpu, memory, tables = row
    return read_facts(device, gpu, memory, tables)


def comparison_context(session: Session, run: Run) -> dict[str, Any]:
    """What must match for two runs to compare fairly: devices, batch size, world size."""
    row = session.execute(
        select(Trace.meta, Analysis.report["device"], Analysis.report["world_size"])
        .outerjoin(Analysis, Analysis.trace_id == Trace.id)
        .where(Trace.run_id == run.id)
        .order_by(Analysis.id.is_(None), Trace.id)
        .limit(1)
    ).first()
    if row is None:
        return {}
    meta, device, world = row
    meta = meta if isinstance(meta, dict) else {}
    loader = meta.get("loader") if isinstance(meta.get("loader"), dict) else {}
    names = [d.get("name") for d in meta.get("devices") or [] if isinstance(d, dict) and d.get("name")]
    if not names and isinstance(device, dict) and device.get("name"):
        names = [device["name"]]
    return {
        "devices": ", ".join(sorted(set(map(str, names))))
        or ("CPU only" if meta or device is None else None),
        "batch_size": (loader or {}).get("batch_size"),
        "world_size": meta.get("world_size") if meta.get("world_size") is not None else world,
    }


def get_or_create_project(session: Session, team_id: int, name: str) -> Project:
    """The team's project of this name, created on first upload (a concurrent creator wins)."""
    query = select(Project).where(Project.team_id == team_id, Project.name == name)
    return get_or_create(session, query, lambda: Project(team_id=team_id, name=name))


def get_or_create_run(session: Session, project: Project, name: str) -> Run:
    """The project's run of this name, created on first upload (a concurrent creator wins)."""
    query = select(Run).where(Run.project_id == project.id, Run.name == name)
    return get_or_create(session, query, lambda: Run(project_id=project.id, name=name, tags=[]))


@dataclass(frozen=True)
class RunComparison:
    """Two runs compared: the one answer the compare page and ``GET /api/v1/compare`` render."""

    base: Run
    base_project: Project
    other: Run
    other_project: Project
    base_diagnosis: RunVerdict
    other_diagnosis: RunVerdict
    comparison: dict[str, Any]


def compare_runs(session: Session, base: tuple[Run, Project], other: tuple[Run, Project]) -> RunComparison:
    """``other`` against ``base`` (``compare.compare_diagnoses`` over their stored verdicts, the step
    times on the basis ``regressions.step_comparison`` and ``stepdoctor check`` use); 409 while
    either has no verdict (``run_diagnosis``)."""
    (base_run, base_project), (other_run, other_project) = base, other
    base_d, other_d = run_diagnosis(base_run), run_diagnosis(other_run)
    step = regressions.step_comparison(session, base_run, base_project, other_run, other_project)
    return RunComparison(
        base_run,
        base_project,
        other_run,
        other_project,
        base_d,
        other_d,
        compare.compare_diagnoses(base_d, other_d, step),
    )
