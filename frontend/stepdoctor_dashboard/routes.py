"""Dashboard pages: server-rendered templates, figures as plotly JSON, cookie login with an API token.

Pages read through the same loaders and permission checks as the REST API (a team sees only its own
objects; others' ids are 404), and downloads call the API's own handlers so bytes are identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from stepdoctor_dashboard import figures
from stepdoctor_server import api_analysis, api_traces, compare
from stepdoctor_server.api_catalog import load_run
from stepdoctor_server.auth import Principal, authenticate
from stepdoctor_server.db import DatabaseDep, SessionDep
from stepdoctor_server.errors import ApiError, not_found
from stepdoctor_server.models import Analysis, Project, Run, Trace

COOKIE = "stepdoctor_token"
HERE = Path(__file__).parent
templates = Jinja2Templates(directory=str(HERE / "templates"))
router = APIRouter(include_in_schema=False)


class LoginRequired(Exception):
    """Raised by the page dependency; answered with a redirect to the login page."""


def page_principal(request: Request, db: DatabaseDep) -> Principal:
    raw = request.cookies.get(COOKIE)
    if not raw:
        raise LoginRequired
    with db.session() as session:
        principal = authenticate(session, raw)
    if principal is None or not principal.allows("read"):
        raise LoginRequired
    return principal


Viewer = Annotated[Principal, Depends(page_principal)]


def install(app: FastAPI) -> None:
    """Mount the pages and their static files (plotly.js from the installed plotly package: offline)."""
    app.mount("/static/plotly", StaticFiles(packages=[("plotly", "package_data")]), name="plotly")
    app.mount("/static/app", StaticFiles(directory=str(HERE / "static")), name="dashboard-static")
    app.include_router(router)

    @app.exception_handler(LoginRequired)
    async def _login(request: Request, _: LoginRequired) -> Response:
        return RedirectResponse(f"/login?next={request.url.path}", status_code=303)


def _render(request: Request, name: str, viewer: Principal | None, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, name, {"viewer": viewer, **context})


# -- login ---------------------------------------------------------------------------------------


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, next: str = "/") -> HTMLResponse:
    return _render(request, "login.html", None, next=_safe_next(next), error=None)


@router.post("/login", response_class=HTMLResponse)
async def login(request: Request, db: DatabaseDep) -> Response:
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    raw = (form.get("token") or [""])[0].strip()
    target = _safe_next((form.get("next") or ["/"])[0])
    with db.session() as session:
        principal = authenticate(session, raw) if raw else None
    if principal is None or not principal.allows("read"):
        message = (
            "Unknown or revoked token." if principal is None else "This token cannot read (upload scope)."
        )
        response = _render(request, "login.html", None, next=target, error=message)
        response.status_code = 401
        return response
    redirect = RedirectResponse(target, status_code=303)
    redirect.set_cookie(COOKIE, raw, httponly=True, samesite="strict", max_age=30 * 86400)
    return redirect


@router.get("/logout")
def logout() -> Response:
    redirect = RedirectResponse("/login", status_code=303)
    redirect.delete_cookie(COOKIE)
    return redirect


def _safe_next(target: str) -> str:
    """Only same-site paths, so the login page cannot bounce a user elsewhere."""
    return target if target.startswith("/") and not target.startswith("//") else "/"


# -- pages ---------------------------------------------------------------------------------------


@router.get("/", response_class=HTMLResponse)
def home(request: Request, viewer: Viewer, session: SessionDep) -> HTMLResponse:
    projects = session.execute(
        select(Project, func.count(Run.id), func.max(Run.updated_at))
        .outerjoin(Run, Run.project_id == Project.id)
        .where(Project.team_id == viewer.team_id)
        .group_by(Project.id)
        .order_by(func.max(Run.updated_at).desc().nulls_last(), Project.name)
    ).all()
    recent = _runs(session, viewer, None, limit=20)
    return _render(request, "home.html", viewer, projects=projects, runs=recent)


@router.get("/projects/{project_id}", response_class=HTMLResponse)
def project_page(request: Request, project_id: int, viewer: Viewer, session: SessionDep) -> HTMLResponse:
    project = session.get(Project, project_id)
    if project is None or project.team_id != viewer.team_id:
        raise not_found("project", project_id)
    return _render(
        request, "project.html", viewer, project=project, runs=_runs(session, viewer, project.id, 500)
    )


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: int, viewer: Viewer, session: SessionDep) -> HTMLResponse:
    run, project = load_run(session, viewer, run_id)
    diagnosis = run.diagnosis or {}
    traces = session.execute(
        select(Trace, Analysis.primary_kind)
        .outerjoin(Analysis, Analysis.trace_id == Trace.id)
        .where(Trace.run_id == run.id)
        .order_by(Trace.rank, Trace.window_index, Trace.id)
    ).all()
    figs = {}
    if diagnosis.get("breakdown"):
        figs["breakdown"] = figures.to_json(figures.breakdown_figure(diagnosis["breakdown"]))
    if diagnosis.get("shares"):
        figs["shares"] = figures.to_json(figures.shares_figure(diagnosis["shares"]))
    if len(diagnosis.get("ranks") or []) > 1:
        figs["ranks"] = figures.to_json(figures.ranks_figure(diagnosis["ranks"]))
    others = session.execute(
        select(Run.id, Run.name).where(Run.project_id == project.id, Run.id != run.id).order_by(Run.name)
    ).all()
    return _render(
        request,
        "run.html",
        viewer,
        run=run,
        project=project,
        d=diagnosis,
        traces=traces,
        figs=figs,
        others=others,
    )


@router.get("/traces/{trace_id}", response_class=HTMLResponse)
def trace_page(request: Request, trace_id: int, viewer: Viewer, session: SessionDep) -> HTMLResponse:
    trace, run, project = api_traces.load_trace(session, viewer, trace_id)
    analysis = session.scalar(select(Analysis).where(Analysis.trace_id == trace.id))
    report: dict[str, Any] = analysis.report if analysis is not None else {}
    figs = {}
    if report.get("breakdown"):
        figs["breakdown"] = figures.to_json(figures.breakdown_figure(report["breakdown"]))
    if report.get("steps"):
        figs["steps"] = figures.to_json(figures.steps_figure(report))
    memory = figures.memory_figure(((report.get("metrics") or {}).get("memory") or {}).get("series") or {})
    if memory is not None:
        figs["memory"] = figures.to_json(memory)
    jobs = [j for j in api_analysis.deep_analyses(session, trace.id) if j.kind == "critical_path"]
    latest = jobs[0] if jobs else None
    shown = next((j for j in jobs if j.status == "done" and j.result), None)
    if shown is not None and shown.result is not None:
        figs["critical_path"] = figures.to_json(figures.critical_path_figure(shown.result))
    return _render(
        request,
        "trace.html",
        viewer,
        trace=trace,
        run=run,
        project=project,
        r=report,
        figs=figs,
        cp_latest=latest,
        cp=shown.result if shown is not None else None,
        can_request=viewer.allows("upload"),
    )


@router.post("/traces/{trace_id}/deep/critical-path")
async def request_critical_path(trace_id: int, request: Request, viewer: Viewer, db: DatabaseDep) -> Response:
    """The page's "Critical path (HTA)" button: the API's service, then back to the trace page.

    The cookie is ``SameSite=Strict``, so another site cannot submit this form on a user's behalf.
    """
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    step_text = (form.get("step") or [""])[0].strip()
    force = (form.get("force") or [""])[0] in ("1", "true", "on")
    if not viewer.allows("upload"):
        raise ApiError(403, "forbidden", "requesting an analysis needs an upload or admin token")
    if step_text and not (step_text.isdigit() and int(step_text) < 2**31):
        raise ApiError(422, "invalid_step", f"step must be a non-negative integer, got {step_text[:40]!r}")
    step = int(step_text) if step_text else None

    def queue_it() -> None:  # blocking database work: off the event loop
        with db.session() as session:
            api_analysis.request_critical_path(session, viewer, trace_id, step=step, force=force)

    await run_in_threadpool(queue_it)
    return RedirectResponse(f"/traces/{trace_id}#critical-path", status_code=303)


@router.get("/compare", response_class=HTMLResponse)
def compare_page(
    request: Request,
    viewer: Viewer,
    session: SessionDep,
    base: Annotated[int, Query()],
    other: Annotated[int, Query()],
) -> HTMLResponse:
    base_run, _ = load_run(session, viewer, base)
    other_run, _ = load_run(session, viewer, other)
    try:
        comparison = compare.compare_diagnoses(
            api_analysis.run_diagnosis(base_run), api_analysis.run_diagnosis(other_run)
        )
    except ApiError as exc:  # a run without analysed traces yet
        return _render(
            request, "compare.html", viewer, base=base_run, other=other_run, c=None, error=exc.message
        )
    fig = figures.to_json(figures.compare_figure(comparison, base_run.name, other_run.name))
    return _render(
        request, "compare.html", viewer, base=base_run, other=other_run, c=comparison, fig=fig, error=None
    )


# -- downloads (the API's handlers, with the page's cookie principal) -----------------------------


@router.get("/traces/{trace_id}/download")
def download(trace_id: int, request: Request, viewer: Viewer, session: SessionDep) -> Response:
    return api_traces.download_trace(trace_id, request, viewer, session)


@router.get("/runs/{run_id}/tensorboard.zip")
def tensorboard(run_id: int, request: Request, viewer: Viewer, session: SessionDep) -> Any:
    return api_analysis.tensorboard_zip(run_id, request, viewer, session)


def _runs(session: Session, viewer: Principal, project_id: int | None, limit: int) -> list[Any]:
    query = (
        select(Run, Project.name)
        .join(Project, Project.id == Run.project_id)
        .where(Project.team_id == viewer.team_id)
        .order_by(Run.updated_at.desc(), Run.id.desc())
        .limit(limit)
    )
    if project_id is not None:
        query = query.where(Run.project_id == project_id)
    return list(session.execute(query).all())


__all__ = ["ApiError", "install", "router"]
