"""Application factory: routers, JSON errors, health, readiness, metrics and the worker pool.

Every error leaves as ``{"error": {"code", "message"}}``; an unexpected exception is logged with
its traceback on the server and answered with a bare 500, never a stack trace to the client.

Every part of the service (API routers, dashboard, worker pool) is imported here by name, so a
rename breaks mypy and the import instead of silently dropping routes; a part that cannot be
imported stops the server at start with an ImportError naming it and the install that fixes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

try:  # the parts of the service: none is optional, so a missing one stops the server at start
    from stepdoctor_server import job_handlers
    from stepdoctor_server.jobs import pool as worker
    from stepdoctor_server.web import (
        api_analysis,
        api_capture,
        api_catalog,
        api_docs,
        api_regressions,
        api_series,
        api_snapshots,
        api_traces,
        capture_page,
    )
    from stepdoctor_server.web import pages as dashboard
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by test_server_app
    # Same class (ModuleNotFoundError stays one), so the console script still answers a missing
    # module with its one-line install hint.
    raise type(exc)(
        f"stepdoctor server cannot start: its part {exc.name or '?'} does not import ({exc}); "
        "reinstall with pip install 'stepdoctor[server]'",
        name=exc.name,
    ) from exc
from stepdoctor_server.auth.tokens import AdminTeam
from stepdoctor_server.core.database import Database
from stepdoctor_server.core.errors import ApiError, TransientError
from stepdoctor_server.core.models import TRACE_STATUSES, Trace
from stepdoctor_server.core.settings import Settings, get_settings
from stepdoctor_server.traces.storage import StoreUnavailable, TraceStore, make_store
from stepdoctor_server.web.schemas import ErrorResponse, HealthOut
from stepdoctor_server.web.security import NulGuardMiddleware, SameOriginMiddleware, SecurityHeadersMiddleware
from stepdoctor_server.web.timeouts import BodyReadTimeoutMiddleware

log = logging.getLogger("stepdoctor.server")
RETRY_AFTER_S = 10  # what a 503 for an unreachable store asks clients to wait


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def _status_code_name(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return "error"


def _validation_message(exc: RequestValidationError) -> str:
    """One line naming the first offending parameter, e.g. ``query parameter 'limit': ...``."""
    errors = exc.errors()
    if not errors:
        return "invalid request"
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ())]
    where = f"{loc[0]} parameter '{'.'.join(loc[1:])}'" if len(loc) > 1 else ".".join(loc) or "request"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid value')}{more}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_request", _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers) if exc.headers else None
        return error_response(exc.status_code, _status_code_name(exc.status_code), str(exc.detail), headers)

    @app.exception_handler(OperationalError)
    async def _database_down(request: Request, exc: OperationalError) -> JSONResponse:
        # Lost connection, "database is locked" past the busy timeout: worth a retry later.
        log.warning("database error on %s %s: %s", request.method, request.url.path, exc.orig or exc)
        return error_response(
            503, "database_unavailable", "database is busy or unreachable; retry later", {"Retry-After": "5"}
        )

    @app.exception_handler(TransientError)
    async def _unreachable(request: Request, exc: TransientError) -> JSONResponse:
        # The store (or another service) is away: nothing was kept, the client retries later.
        # The details (endpoint, bucket, key) were logged where the error was raised.
        log.warning("%s %s: %s", request.method, request.url.path, exc)
        code = "storage_unavailable" if isinstance(exc, StoreUnavailable) else "service_unavailable"
        return error_response(503, code, f"{exc}; retry later", {"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(ClientDisconnect)
    async def _disconnected(_: Request, __: ClientDisconnect) -> JSONResponse:
        return error_response(
            400, "client_disconnected", "the client disconnected before the body was complete"
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", "internal server error (see the server log)")


# -- metrics -------------------------------------------------------------------------------------


class _QueueCollector(Collector):
    """Trace counts per status at scrape time: the analysis backlog is the ``pending`` gauge."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily("stepdoctor_traces", "Traces by analysis status", labels=["status"])
        try:
            with self.db.session(read_only=True) as session:
                query = select(Trace.status, func.count(Trace.id)).group_by(Trace.status)
                counts = {status: n for status, n in session.execute(query)}
        except Exception:
            return []
        for status in TRACE_STATUSES:
            family.add_metric([status], counts.get(status, 0))
        return [family]


class Metrics:
    """Per-app registry, so several apps (tests) never collide in the global one."""

    def __init__(self, db: Database) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "stepdoctor_http_requests",
            "HTTP requests by route template, method and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "stepdoctor_http_request_duration_seconds",
            "HTTP request latency by route template",
            ["method", "route"],
            registry=self.registry,
        )
        self.upload_bytes = Counter(
            "stepdoctor_upload_bytes", "Bytes of accepted trace uploads", registry=self.registry
        )
        self.registry.register(_QueueCollector(db))


class MetricsMiddleware:
    """Pure ASGI (does not buffer bodies): counts requests and times them by route template."""

    def __init__(self, app: ASGIApp, metrics_of: Callable[[], Metrics]) -> None:
        self.app = app
        self.metrics_of = metrics_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            metrics = self.metrics_of()
            metrics.requests.labels(scope["method"], route, str(status)).inc()
            metrics.latency.labels(scope["method"], route).observe(time.perf_counter() - start)
            if route == "/api/v1/traces" and scope["method"] == "POST" and status == 201:
                metrics.upload_bytes.inc(_content_length(scope))


def _content_length(scope: Scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


class AmbiguousLengthMiddleware:
    """400 for a request carrying both ``Content-Length`` and ``Transfer-Encoding``.

    RFC 9112 §6.1 lets a server read such a message by ``Transfer-Encoding``, but a proxy in
    front may have framed it by ``Content-Length``: the two then disagree on where the request
    ends, which is how requests are smuggled past a proxy. So it is refused, and the connection
    closed (whatever follows on it cannot be trusted).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            names = {name.lower() for name, _ in scope.get("headers", ())}
            if b"content-length" in names and b"transfer-encoding" in names:
                response = error_response(
                    400,
                    "ambiguous_length",
                    "the request has both Content-Length and Transfer-Encoding; send one of them",
                    {"Connection": "close"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- worker pool ---------------------------------------------------------------------------------


def _start_workers(settings: Settings) -> worker.Pool | None:
    """The in-process analysis pool; none with ``workers=0`` (API-only replicas)."""
    if settings.workers <= 0:
        return None
    return job_handlers.start_pool(settings)


def _stop_workers(handle: worker.Pool | None, timeout: float) -> None:
    if handle is not None:
        handle.stop(timeout)


def begin_shutdown(app: FastAPI) -> None:
    """SIGTERM arrived (``cli.serve``): the grace period starts now, for requests and workers alike.

    The workers are told at once (they finish or abandon their jobs while requests drain); the
    lifespan's shutdown then waits only for what is left of the same grace period.
    """
    if getattr(app.state, "stop_deadline", None) is None:
        app.state.stop_deadline = time.monotonic() + app.state.settings.shutdown_grace_s
    if app.state.workers is not None:
        app.state.workers.request_stop()


def _grace_left(app: FastAPI) -> float:
    deadline = getattr(app.state, "stop_deadline", None)
    if deadline is None:  # stopped without a signal (tests, an embedding program): the full grace
        return float(app.state.settings.shutdown_grace_s)
    return max(0.0, deadline - time.monotonic())


class _PartialCleaner:
    """Removes stage files of crashed uploads at start and then every ``INTERVAL_S`` (a thread)."""

    INTERVAL_S = 600.0

    def __init__(self, store: Any) -> None:
        self.store = store
        self._stop = threading.Event()

    def start(self) -> _PartialCleaner:
        threading.Thread(target=self._run, name="stepdoctor-partials", daemon=True).start()
        return self

    def _run(self) -> None:
        while True:
            try:
                self.store.cleanup_partials()
            except OSError as exc:
                log.warning("could not clean partial uploads: %s", exc)
            if self._stop.wait(self.INTERVAL_S):
                return

    def stop(self) -> None:
        self._stop.set()


# -- factory -------------------------------------------------------------------------------------


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    db = Database(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        handle = await anyio.to_thread.run_sync(_start_workers, settings)
        cleaner = _PartialCleaner(app.state.store).start()  # stage files of crashed uploads
        app.state.workers = handle
        try:
            yield
        finally:
            cleaner.stop()
            await anyio.to_thread.run_sync(_stop_workers, handle, _grace_left(app))
            db.dispose()

    app = FastAPI(
        title="stepdoctor",
        summary="Profiler-driven bottleneck diagnosis for PyTorch training",
        version=_version(),
        lifespan=lifespan,
        responses={401: {"model": ErrorResponse}, 500: {"model": ErrorResponse}},
        docs_url=None,  # api_docs serves /docs and /redoc from packaged assets, not a CDN
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.db = db
    app.state.store = make_store(settings)
    app.state.metrics = Metrics(db)
    app.state.workers = None
    install_error_handlers(app)
    app.add_middleware(MetricsMiddleware, metrics_of=lambda: app.state.metrics)
    # Hardening (#12); the last added runs first: headers on every response, even refusals.
    app.add_middleware(
        BodyReadTimeoutMiddleware,
        read_timeout_s=settings.body_read_timeout_s,
        min_rate_bytes_s=settings.body_min_rate_bytes_s,
        stopping_at=lambda: getattr(app.state, "stop_deadline", None),
    )
    app.add_middleware(SameOriginMiddleware)
    app.add_middleware(AmbiguousLengthMiddleware)
    app.add_middleware(NulGuardMiddleware)
    app.add_middleware(SecurityHeadersMiddleware)
    app.include_router(api_traces.router)
    app.include_router(api_catalog.router)
    app.include_router(api_analysis.router)
    app.include_router(api_regressions.router)
    app.include_router(api_series.router)
    app.include_router(api_capture.router)
    app.include_router(capture_page.router)  # the run page's "Capture now" form
    app.include_router(api_snapshots.router)  # a trace's memory snapshot
    app.include_router(api_snapshots.page_router)
    _install_health(app)
    api_docs.install(app)
    dashboard.install(app)  # last: its HTML error pages wrap the JSON handlers installed above
    return app


def _install_health(app: FastAPI) -> None:
    @app.get("/healthz", response_model=HealthOut, tags=["ops"], summary="Liveness: the process answers")
    async def healthz() -> HealthOut:
        return HealthOut(status="ok")

    @app.get(
        "/readyz",
        response_model=HealthOut,
        tags=["ops"],
        responses={503: {"model": ErrorResponse}},
        summary="Readiness: the database and the trace store answer",
    )
    async def readyz(request: Request) -> Response:
        db: Database = request.app.state.db
        store: TraceStore = request.app.state.store
        down = [
            part
            for part, ping in (("database", db.ping), ("trace store", store.ping))
            if not await anyio.to_thread.run_sync(_answers, part, ping)
        ]
        if down:
            code = "database_unavailable" if "database" in down else "storage_unavailable"
            return error_response(503, code, f"not ready: {' and '.join(down)} not reachable")
        return JSONResponse({"status": "ok"})

    @app.get(
        "/metrics",
        tags=["ops"],
        summary="Prometheus metrics (admin token: the counts span every team)",
        response_class=Response,
        responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}},
    )
    async def metrics(request: Request, _: AdminTeam) -> Response:
        registry = request.app.state.metrics.registry
        body = await anyio.to_thread.run_sync(generate_latest, registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)


def _answers(part: str, ping: Callable[[], object]) -> bool:
    try:
        ping()
    except Exception as exc:  # logged here; the response names only the part
        log.warning("readiness: %s not reachable: %s", part, (str(exc).splitlines() or [""])[0][:300])
        return False
    return True


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("stepdoctor")
    except Exception:
        return "0.0.0"
