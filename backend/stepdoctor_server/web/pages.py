"""Dashboard pages: server-rendered templates, figures as plotly JSON, cookie login with an API token.

Pages read through the domain services the REST API also calls (``stepdoctor_server.<domain>.service``:
the same queries and permission checks; a team sees only its own objects, others' ids are 404), and
downloads go through the same service as the API's, so the bytes are identical.
Every verdict, share and recommendation comes from the stored run diagnosis or trace report, the
same JSON the API returns; templates only format it.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import parse_qs, urlencode

import msgspec
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from stepdoctor_analysis import BOTTLENECK_KINDS
from stepdoctor_analysis.run.verdict import RunVerdict
from stepdoctor_dashboard import assets, figures, memory_figures, rank_figures, timeline_figures
from stepdoctor_dashboard.rank_figures import RankPlace
from stepdoctor_server.auth import sessions
from stepdoctor_server.auth.tokens import Principal, authenticate
from stepdoctor_server.core.database import DatabaseDep, SessionDep, settings_of
from stepdoctor_server.core.errors import ApiError, check_id, not_found
from stepdoctor_server.core.models import Analysis, Project, Trace
from stepdoctor_server.deep import service as deep
from stepdoctor_server.runs import compare, regressions, series
from stepdoctor_server.runs import service as runs
from stepdoctor_server.runs.capture import capture_view
from stepdoctor_server.traces import service as traces
from stepdoctor_server.traces.reports import ReportFacts, facts_of
from stepdoctor_server.traces.snapshots import snapshot_of
from stepdoctor_server.web import guide_page
from stepdoctor_server.web.render import HERE, templates
from stepdoctor_server.web.render import render as _render

COOKIE = sessions.COOKIE  # a random session id (sessions.py), never the API token
router = APIRouter(include_in_schema=False)

# Paths for programs, not people: their errors stay JSON.
_MACHINE_PATHS = ("/api", "/docs", "/openapi", "/redoc", "/metrics", "/healthz", "/readyz", "/static/")
MAX_TRACES_LISTED = 50  # the run page's trace table; every rank's trace is in its paginated rank table
# A run page reads a few JSON fields of each trace it lists and of WARNING_TRACES traces (on
# PostgreSQL each such read parses the whole report: ~5 ms for a 128 KB report on a busy 2-core box).
WARNING_TRACES = 8  # the lead trace's and the stragglers' first, then the first by id
MANY_RANKS_TRACES_LISTED = 10  # a run of many ranks lists fewer: its rank table links every trace
REFRESH_S = 5  # pages with traces still being analysed reload themselves this often
LIVE_REFRESH_S = 30  # a live run's page (its timeline grows with each series chunk)


class LoginRequired(Exception):
    """Raised by the page dependency; answered with a redirect to the login page, which says why
    (``reason``: ``sessions.lookup``'s, e.g. "expired")."""

    def __init__(self, reason: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason


# What the login page says when a session ended without the user logging out.
LOGIN_REASONS = {
    "expired": "Your session expired. Log in again to continue.",
    "token": "The token this session was started with was revoked or expired. Log in with a live one.",
    "unknown": "Your session ended. Log in again to continue.",
}


def page_principal(request: Request, db: DatabaseDep) -> Principal:
    raw = request.cookies.get(COOKIE)
    signed_in = bool(request.cookies.get(sessions.SIGNED_IN_COOKIE))
    with db.session() as session:  # no query without a cookie: only says why there is none
        principal, reason = sessions.lookup(session, raw, signed_in=signed_in)
    if principal is None or not principal.allows("read"):
        raise LoginRequired(reason)
    return principal


Viewer = Annotated[Principal, Depends(page_principal)]


def install(app: FastAPI) -> None:
    """Mount the pages, their static files and HTML error pages for everything outside the API."""
    assets.install(app, HERE / "static")
    # Unversioned plotly path kept for old bookmarks and pages; the templates use the versioned one.
    app.mount("/static/plotly", StaticFiles(packages=[("plotly", "package_data")]), name="plotly")
    app.include_router(router)
    guide_page.install(app, templates.env)

    @app.exception_handler(LoginRequired)
    async def _login(request: Request, exc: LoginRequired) -> Response:
        query = {"next": request.url.path, **({"reason": exc.reason} if exc.reason else {})}
        redirect = RedirectResponse(f"/login?{urlencode(query)}", status_code=303)
        if exc.reason:  # said once: the dead cookies go with the redirect that explains them
            sessions.clear_cookies(redirect, request)
        return redirect

    _html_errors(app)


def _html_errors(app: FastAPI) -> None:
    """Browsers get an HTML page for errors on dashboard paths; the API keeps its JSON errors."""
    json_api_error = app.exception_handlers.get(ApiError)
    json_http_error = app.exception_handlers.get(StarletteHTTPException)
    json_validation_error = app.exception_handlers.get(RequestValidationError)

    def wants_html(request: Request) -> bool:
        return not request.url.path.startswith(_MACHINE_PATHS)

    def page(request: Request, status: int, message: str) -> Response:
        response = _render(request, "error.html", None, status=status, message=message)
        response.status_code = status
        return response

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        if wants_html(request) or json_api_error is None:
            return page(request, exc.status, exc.message)
        answer: Any = json_api_error(request, exc)
        return await answer

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        if wants_html(request) or json_validation_error is None:
            return page(request, 422, _validation_text(exc))
        answer: Any = json_validation_error(request, exc)
        return await answer

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if wants_html(request) or json_http_error is None:
            message = "No such page." if exc.status_code == 404 else str(exc.detail)
            return page(request, exc.status_code, message)
        answer: Any = json_http_error(request, exc)
        return await answer


def _validation_text(exc: RequestValidationError) -> str:
    """A bad query or path value in a sentence: ``base: Input should be a valid integer (got 'x')``."""
    parts = []
    for error in exc.errors()[:3]:
        where = ".".join(str(x) for x in error.get("loc", ())[1:]) or "request"
        got = error.get("input")
        shown = f" (got {str(got)[:40]!r})" if isinstance(got, str | int | float) else ""
        parts.append(f"{where}: {error.get('msg', 'invalid')}{shown}")
    return "Invalid address: " + "; ".join(parts) + "."


# -- login ---------------------------------------------------------------------------------------


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, next: str = "/", reason: str = "") -> HTMLResponse:
    notice = LOGIN_REASONS.get(reason)
    return _render(request, "login.html", None, next=_safe_next(next), error=None, notice=notice)


@router.post("/login", response_class=HTMLResponse)
async def login(request: Request, db: DatabaseDep) -> Response:
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    raw = (form.get("token") or [""])[0].strip()
    target = _safe_next((form.get("next") or ["/"])[0])
    session_id = ""
    with db.session() as session:
        principal = authenticate(session, raw) if raw else None
        if principal is not None and principal.allows("read"):
            session_id = sessions.start(session, principal)
    if principal is None or not principal.allows("read"):
        message = (
            "Unknown or revoked token." if principal is None else "This token cannot read (upload scope)."
        )
        response = _render(request, "login.html", None, next=target, error=message, notice=None)
        response.status_code = 401
        return response
    redirect = RedirectResponse(target, status_code=303)
    sessions.set_cookie(redirect, request, session_id)
    return redirect


@router.post("/logout")
@router.get("/logout")
def logout(request: Request, db: DatabaseDep) -> Response:
    """End the session server-side (the cookie alone is worthless afterwards) and clear it."""
    with db.session() as session:
        sessions.end(session, request.cookies.get(COOKIE))
    redirect = RedirectResponse("/login", status_code=303)
    sessions.clear_cookies(redirect, request)
    return redirect


def _safe_next(target: str) -> str:
    """Only same-site paths, so the login page cannot bounce a user elsewhere."""
    return target if target.startswith("/") and not target.startswith("//") else "/"


# -- lists ---------------------------------------------------------------------------------------


@router.get("/", response_class=HTMLResponse)
def home(request: Request, viewer: Viewer, session: SessionDep) -> HTMLResponse:
    projects = runs.team_projects(session, viewer)
    recent = runs.recent_runs(session, viewer, 20)
    liveness = series.liveness_of_runs(session, [run.id for run, _ in recent])
    return _render(request, "home.html", viewer, projects=projects, runs=recent, liveness=liveness)


class RunFilter:
    """The run list's search, filters, sort and page, read from the query string."""

    def __init__(
        self, q: str = "", kind: str = "", tag: str = "", sort: str = "updated", page: int = 1
    ) -> None:
        self.q = q.strip()[:128]
        self.kind = kind if kind in (*BOTTLENECK_KINDS, "pending") else ""
        self.tag = tag.strip()[:128]
        self.sort = sort if sort in runs.RUN_SORTS else "updated"
        self.page = max(1, min(page, 10**6))

    def link(self, **change: Any) -> str:
        values = {"q": self.q, "kind": self.kind, "tag": self.tag, "sort": self.sort, "page": self.page}
        values.update(change)
        return "?" + urlencode({k: v for k, v in values.items() if v not in ("", None, 1, "updated")})


def run_filter(
    q: Annotated[str, Query(max_length=256)] = "",
    kind: Annotated[str, Query(max_length=32)] = "",
    tag: Annotated[str, Query(max_length=256)] = "",
    sort: Annotated[str, Query(max_length=32)] = "updated",
    page: Annotated[int, Query(ge=1, le=10**6)] = 1,
) -> RunFilter:
    return RunFilter(q, kind, tag, sort, page)


Filters = Annotated[RunFilter, Depends(run_filter)]


@router.get("/projects/{project_id}", response_class=HTMLResponse)
def project_page(
    request: Request, project_id: int, viewer: Viewer, session: SessionDep, f: Filters
) -> HTMLResponse:
    project = session.get(Project, check_id("project", project_id))
    if project is None or project.team_id != viewer.team_id:
        raise not_found("project", project_id)
    listing = _paged_runs(session, viewer, project.id, f)
    return _render(request, "project.html", viewer, project=project, f=f, **listing)


@router.get("/runs", response_class=HTMLResponse)
def runs_page(request: Request, viewer: Viewer, session: SessionDep, f: Filters) -> HTMLResponse:
    return _render(request, "runs.html", viewer, f=f, **_paged_runs(session, viewer, None, f))


def _paged_runs(session: Session, viewer: Principal, project_id: int | None, f: RunFilter) -> dict[str, Any]:
    listing = runs.page_of_runs(
        session, viewer, project_id, q=f.q, kind=f.kind, tag=f.tag, sort=f.sort, page=f.page
    )
    statuses = {run.id: regressions.read_regression(run.regression) for run, _ in listing["runs"]}
    liveness = series.liveness_of_runs(session, [run.id for run, _ in listing["runs"]])
    return {**listing, "kinds": BOTTLENECK_KINDS, "regressions": statuses, "liveness": liveness}


# -- run -----------------------------------------------------------------------------------------


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(
    request: Request,
    run_id: int,
    viewer: Viewer,
    session: SessionDep,
    ranks_page: Annotated[int, Query(ge=0, le=10_000)] = 0,
) -> HTMLResponse:
    run, project = runs.load_run(session, viewer, run_id)
    state = runs.run_state(session, run)
    d = state.verdict or RunVerdict()
    listed = MANY_RANKS_TRACES_LISTED if len(d.ranks) > rank_figures.SMALL_RUN else MAX_TRACES_LISTED
    trace_rows, trace_count = runs.run_traces(session, run.id, listed)
    places = {k: RankPlace(t, h) for k, (t, h) in runs.rank_places(session, run.id).items()}
    first = [d.lead_trace_id, *(rank_figures.trace_of(places, s) for s in d.stragglers)]
    rep_id, warnings, read = runs.run_facts(
        session,
        run.id,
        first=[i for i in first if i is not None],
        limit=WARNING_TRACES,
        slowest=d.lead_trace_id is None,
    )
    if read < d.traces:  # a 1,000-rank run: its lead's and stragglers' traces, then the first by id
        warnings = [*warnings, f"analysis warnings of {read} of the run's {d.traces} traces are shown"]
    if d.lead_trace_id is not None:  # the trace whose report stands for the run's verdict (as on the CLI)
        rep_id = d.lead_trace_id
    facts = runs.facts_report(session, rep_id) if rep_id is not None else None
    figs: dict[str, figures.Fig] = {}
    if d.breakdown:
        figs["breakdown"] = figures.breakdown_figure(d.breakdown)
    if d.shares:
        figs["shares"] = figures.shares_figure(d.shares)
    rank_view = None
    if len(d.ranks) > 1:  # every rank, the metric the stragglers were judged by, the stragglers marked
        rank_view = rank_figures.rank_section(d, places, ranks_page)
        if rank_view is not None and rank_view.figure is not None:
            figs["ranks"] = rank_view.figure
    timeline = series.run_timeline_of(
        session, run.id, fresh_within_s=settings_of(session).run_timeline_refresh_s
    )
    if timeline is not None:  # every step the agent timed, downsampled for the plot
        figs["timeline"] = timeline_figures.run_timeline_figure(timeline)
    others = runs.sibling_runs(session, run, 200)
    waiting = any(t.status in ("pending", "running") for t, _, _ in trace_rows)
    capture = capture_view(session, viewer, run)  # "Capture now" while live, and the latest request
    liveness = series.liveness_of(session, run.id)
    refresh_s, refresh_reason = None, None
    if waiting or capture.waiting:
        refresh_s, refresh_reason = REFRESH_S, None if waiting else "A capture was requested"
    elif liveness == "live":  # the timeline and the state follow the run
        refresh_s, refresh_reason = LIVE_REFRESH_S, "The run is live"
    return _render(
        request,
        "run.html",
        viewer,
        run=run,
        project=project,
        d=d,
        stale=state.stale,
        traces=[(t, kind, _steps_label(t, steps)) for t, kind, steps in trace_rows],
        trace_count=trace_count,
        figs=figs,
        others=others,
        warnings=[*d.warnings, *(w for w in warnings if w not in d.warnings)],
        facts=_device_facts(facts),
        tables=(facts.tables if facts is not None else None) or {},
        rep_trace=rep_id,
        collectives=_collectives(session, rep_id),
        refresh_s=refresh_s,
        refresh_reason=refresh_reason,
        capture=capture,
        regression=regressions.read_regression(run.regression),
        baseline=regressions.chosen_baseline(session, project.id),
        can_choose_baseline=viewer.allows("upload"),
        rank_view=rank_view,
        timeline=timeline,
        liveness=liveness,
    )


def _collectives(session: Session, trace_id: int | None) -> list[dict[str, Any]]:
    """The collective-by-type rows of a trace's report (``comm.CollectiveStat``, what the CLI
    prints), read as one JSON field: the run page shows its representative trace's."""
    if trace_id is None:
        return []
    rows = session.execute(
        select(Analysis.report["metrics"]["communication"]["by_type"]).where(Analysis.trace_id == trace_id)
    ).scalar()
    return [r for r in rows if isinstance(r, dict) and r.get("type")] if isinstance(rows, list) else []


def _device_facts(facts: ReportFacts | None) -> dict[str, Any]:
    """Device summary from a report's typed parts: GPU name and memory, TensorBoard's GPU figures,
    memory peak (``metrics.memory`` is still a free-form section, so its rows are checked)."""
    device, gpu = (facts.device, facts.gpu) if facts is not None else (None, None)
    memory = [
        m
        for m in (facts.memory_devices if facts is not None else [])
        if isinstance(m, dict) and str(m.get("device", "")).startswith("cuda")
    ]
    peak = max(memory, key=lambda m: m.get("peak_fraction") or 0.0, default=None)
    tables = facts.tables if facts is not None else None
    return {
        "device": device.name if device else None,
        "capability": device.compute_capability if device else None,
        "memory_gb": device.memory_gb if device else None,
        "utilization": gpu.utilization if gpu else None,
        "sm_efficiency": gpu.sm_efficiency if gpu else None,
        "occupancy": gpu.occupancy if gpu else None,
        "tensor_core_share": tables.tensor_core_share if tables else None,
        "memory_peak": max(peak.get("peak_allocated") or 0, peak.get("peak_reserved") or 0) if peak else None,
        "memory_capacity": peak.get("capacity") if peak else None,
        "memory_fraction": peak.get("peak_fraction") if peak else None,
        "cpu_only": facts is not None and not device and not gpu,
    }


def _steps_label(trace: Trace, steps: Any) -> str:
    """The trace's step numbers: from the upload metadata, else from its report."""
    if trace.first_step is not None:
        last = trace.last_step if trace.last_step is not None else trace.first_step
        return str(trace.first_step) if last == trace.first_step else f"{trace.first_step}–{last}"
    numbers: list[int] = [
        s["number"] for s in steps or [] if isinstance(s, dict) and isinstance(s.get("number"), int)
    ]
    if not numbers:
        return ""
    return str(numbers[0]) if len(numbers) == 1 else f"{min(numbers)}–{max(numbers)}"


# -- trace ---------------------------------------------------------------------------------------


@router.get("/traces/{trace_id}", response_class=HTMLResponse)
def trace_page(
    request: Request,
    trace_id: int,
    viewer: Viewer,
    session: SessionDep,
    step: Annotated[int | None, Query(ge=0, lt=2**31)] = None,
) -> HTMLResponse:
    trace, run, project = traces.load_trace(session, viewer, trace_id)
    mine = traces.trace_report(session, trace)
    doc, stale = mine.doc, mine.stale
    figs: dict[str, figures.Fig] = {}
    if doc is not None:
        figs["breakdown"] = figures.breakdown_figure(msgspec.structs.asdict(doc.breakdown))
    if doc is not None and doc.steps:
        figs["steps"] = figures.steps_figure(doc.steps)
    # ``metrics.memory`` and ``timeline`` are free-form sections of the contract: read guarded.
    memory = (
        figures.memory_figure(doc.metrics.memory.series, doc.metrics.memory.devices)
        if doc is not None
        else None
    )
    if memory is not None:
        figs["memory"] = memory
    if doc is not None:  # what holds the memory, stacked per device: memory_use_0, memory_use_1, ...
        figs.update(memory_figures.memory_use_figures(doc.metrics.memory))
    timeline = (doc.timeline if doc is not None else None) or {}
    drawn = [s for s in timeline.get("steps") or [] if isinstance(s, dict)]
    shown_step = next((s for s in drawn if s.get("number") == step), drawn[0] if drawn else None)
    if shown_step is not None:
        figs["step"] = figures.step_figure(shown_step, timeline.get("names") or [])
    jobs = [j for j in deep.deep_analyses(session, trace.id) if j.kind == "critical_path"]
    latest = jobs[0] if jobs else None
    shown = next((j for j in jobs if j.status == "done" and j.result), None)
    if shown is not None and shown.result is not None:
        figs["critical_path"] = figures.critical_path_figure(shown.result)
    step_numbers = [s.number for s in doc.steps] if doc is not None else []
    return _render(
        request,
        "trace.html",
        viewer,
        trace=trace,
        run=run,
        project=project,
        r=doc or {},
        stale=stale,
        figs=figs,
        facts=_device_facts(facts_of(doc) if doc is not None else None),
        drawn=drawn,
        shown_step=shown_step,
        step_numbers=step_numbers,
        cp_latest=latest,
        cp=shown.result if shown is not None else None,
        snapshot=snapshot_of(session, trace.id),  # the window's CUDA memory snapshot, if the agent sent one
        can_request=viewer.allows("upload") and _hta_available(),
        hta=_hta_available(),
        refresh_s=REFRESH_S
        if trace.status in ("pending", "running") or (latest and latest.status in ("pending", "running"))
        else None,
    )


def _hta_available() -> bool:
    from stepdoctor_analysis.analyzers.deep import available

    return bool(available())


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
    if not _hta_available():
        raise ApiError(
            501, "hta_missing", "this server cannot run HTA analyses (stepdoctor[hta] not installed)"
        )
    if step_text and not (step_text.isdigit() and int(step_text) < 2**31):
        raise ApiError(422, "invalid_step", f"step must be a non-negative integer, got {step_text[:40]!r}")
    step = int(step_text) if step_text else None

    def queue_it() -> None:  # blocking database work: off the event loop
        with db.session() as session:
            deep.request_critical_path(session, viewer, trace_id, step=step, force=force)

    await run_in_threadpool(queue_it)
    return RedirectResponse(f"/traces/{trace_id}#critical-path", status_code=303)


@router.post("/runs/{run_id}/baseline")
async def choose_baseline(run_id: int, request: Request, viewer: Viewer, db: DatabaseDep) -> Response:
    """The run page's "Use as baseline" / "Back to the median" form (the API's service; the
    same-origin check and the ``SameSite=Strict`` cookie keep other sites from submitting it)."""
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    action = (form.get("action") or [""])[0]
    if action not in ("set", "clear"):
        raise ApiError(422, "invalid_request", "action must be 'set' or 'clear'")

    def choose() -> None:  # blocking database work: off the event loop
        with db.session() as session:
            run, project = runs.load_run(session, viewer, run_id)
            regressions.set_baseline(session, viewer, project, run if action == "set" else None)

    await run_in_threadpool(choose)
    return RedirectResponse(f"/runs/{run_id}#regression", status_code=303)


# -- compare -------------------------------------------------------------------------------------


@router.get("/compare", response_class=HTMLResponse)
def compare_page(
    request: Request,
    viewer: Viewer,
    session: SessionDep,
    base: Annotated[int, Query()],
    other: Annotated[int, Query()],
) -> HTMLResponse:
    base_run, base_project = runs.load_run(session, viewer, base)
    other_run, other_project = runs.load_run(session, viewer, other)
    try:
        c = runs.compare_runs(session, (base_run, base_project), (other_run, other_project))
    except ApiError as exc:  # a run without analysed traces yet
        return _render(
            request,
            "compare.html",
            viewer,
            base=base_run,
            base_project=base_project,
            other=other_run,
            c=None,
            error=exc.message,
        )
    comparison = c.comparison
    differences = compare.context_differences(
        runs.comparison_context(session, base_run), runs.comparison_context(session, other_run)
    )
    fig = figures.compare_figure(comparison, base_run.name, other_run.name)
    kinds_fig = figures.kind_delta_figure(comparison.get("kinds") or {})
    return _render(
        request,
        "compare.html",
        viewer,
        base=base_run,
        base_project=base_project,
        other=other_run,
        c=comparison,
        fig=fig,
        kinds_fig=kinds_fig,
        differences=differences,
        error=None,
    )


# -- downloads (the API's services, with the page's cookie principal) -----------------------------


@router.get("/traces/{trace_id}/download")
def download(
    trace_id: int,
    request: Request,
    viewer: Viewer,
    session: SessionDep,
    steps: Annotated[str | None, Query(max_length=32)] = None,
) -> Response:
    return traces.download(session, viewer, request.app.state.store, trace_id, request, steps=steps or None)


@router.get("/runs/{run_id}/tensorboard.zip")
def tensorboard(run_id: int, request: Request, viewer: Viewer, session: SessionDep) -> Any:
    return runs.tensorboard_zip(session, viewer, request.app.state.store, run_id)


__all__ = ["ApiError", "install", "router"]
