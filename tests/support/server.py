"""Fixtures and helpers shared by the server tests (server-core and analysis/worker).

Registered for every test through ``pytest_plugins = ["support.server"]`` in ``tests/conftest.py``.

- ``db_url`` (session scope) is parametrized over SQLite and PostgreSQL (marked ``postgres``): the
  schema is built by running the Alembic migrations once per backend. For PostgreSQL a fresh,
  uniquely named database is created on 127.0.0.1:5432 (user postgres) and dropped at the end; the
  param is skipped with a clear reason when the server is unreachable.
- ``server_settings`` points at that database and a per-test data dir (so a per-test trace store);
  ``workers=0``, so no analysis pool starts unless a test asks for one.
- ``app`` is ``create_app(server_settings)``; every table is emptied before and after each test, so
  tests never see each other's rows (nor each other's pending traces in the queue).
- ``team`` is a fresh team; ``admin_token``, ``upload_token`` and ``read_token`` belong to it;
  ``make_token(scope, team_name=None)`` makes more (another team's, for isolation tests).
- ``client`` is a TestClient (lifespan run) whose default header carries the admin token; pass
  ``headers=bearer(token)`` to act with another token.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import delete, func, select

from stepdoctor_analysis import ENGINE_VERSION, SCHEMA_VERSION
from stepdoctor_server.auth import tokens as auth
from stepdoctor_server.core import migrate
from stepdoctor_server.core.models import Analysis, Base, Trace
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.web.app import create_app
from support.fixtures import TRACES

__all__ = [
    "DB_BACKENDS",
    "FIXTURE_TRACES",
    "POSTGRES_ADMIN_URL",
    "ServerProcess",
    "TeamInfo",
    "admin_token",
    "app",
    "bearer",
    "client",
    "db_url",
    "drain",
    "make_token",
    "migrated_database",
    "read_token",
    "row_counts",
    "serve_subprocess",
    "server_settings",
    "small_trace_bytes",
    "store_files",
    "synthetic_trace",
    "team",
    "upload",
    "upload_token",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE_TRACES = TRACES
POSTGRES_HOST = "127.0.0.1"
POSTGRES_ADMIN_URL = f"postgresql+psycopg://postgres@{POSTGRES_HOST}:5432/postgres"


# -- database ------------------------------------------------------------------------------------


def _postgres_unreachable_reason() -> str | None:
    try:
        import psycopg

        with psycopg.connect(
            host=POSTGRES_HOST, port=5432, user="postgres", dbname="postgres", connect_timeout=3
        ):
            return None
    except Exception as exc:  # any failure means "cannot test PostgreSQL here"
        return (
            f"PostgreSQL not reachable on {POSTGRES_HOST}:5432 as user postgres ({type(exc).__name__}: {exc})"
        )


@contextmanager
def _fresh_postgres_database() -> Iterator[str]:
    import psycopg

    name = f"stepdoctor_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    params: dict[str, Any] = {"host": POSTGRES_HOST, "port": 5432, "user": "postgres", "dbname": "postgres"}
    with psycopg.connect(**params, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@{POSTGRES_HOST}:5432/{name}"
    finally:
        with psycopg.connect(**params, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# The backends ``db_url`` is parametrized over; a module that needs a database of its own
# overrides ``db_url`` with these params and ``migrated_database``.
DB_BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


@contextmanager
def migrated_database(backend: str, data_dir: Path) -> Iterator[str]:
    """A fresh database of ``backend`` with the schema migrated; PostgreSQL's is dropped after.

    Skips (with the reason) when PostgreSQL is unreachable.
    """
    if backend == "sqlite":
        url = f"sqlite:///{data_dir / 'stepdoctor.sqlite3'}"
        migrate.upgrade(Settings(data_dir=data_dir, database_url=url))
        yield url
        return
    reason = _postgres_unreachable_reason()
    if reason is not None:
        pytest.skip(reason)
    with _fresh_postgres_database() as url:
        migrate.upgrade(Settings(data_dir=data_dir, database_url=url))
        yield url


@pytest.fixture(scope="session", params=DB_BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A migrated database URL, once per backend per test session."""
    with migrated_database(request.param, tmp_path_factory.mktemp(f"db-{request.param}")) as url:
        yield url


@pytest.fixture
def server_settings(db_url: str, tmp_path: Path) -> Settings:
    """Settings for one test: the shared migrated database, a private data dir, no worker pool."""
    return Settings(data_dir=tmp_path / "data", database_url=db_url, workers=0)


def _empty_all_tables(app: FastAPI) -> None:
    with app.state.db.session() as session:
        for table in reversed(Base.metadata.sorted_tables):
            session.execute(delete(table))


@pytest.fixture
def app(server_settings: Settings) -> Iterator[FastAPI]:
    application = create_app(server_settings)
    _empty_all_tables(application)
    try:
        yield application
    finally:
        _empty_all_tables(application)
        application.state.db.dispose()


# -- teams and tokens ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TeamInfo:
    id: int
    name: str


def _create_team(app: FastAPI, name: str) -> TeamInfo:
    with app.state.db.session() as session:
        team, _ = auth.get_or_create_team(session, name)
        return TeamInfo(id=team.id, name=team.name)


def _create_token(app: FastAPI, team_name: str, scope: str) -> str:
    with app.state.db.session() as session:
        team, _ = auth.get_or_create_team(session, team_name)
        _, raw = auth.create_token(session, team, scope=scope, name=f"test-{scope}")
        return raw


@pytest.fixture
def team(app: FastAPI) -> TeamInfo:
    return _create_team(app, f"team-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def make_token(app: FastAPI, team: TeamInfo) -> Callable[..., str]:
    """``make_token(scope, team_name=None)``: a new token (for ``team`` unless another name is given)."""

    def factory(scope: str, team_name: str | None = None) -> str:
        return _create_token(app, team_name or team.name, scope)

    return factory


@pytest.fixture
def admin_token(make_token: Callable[..., str]) -> str:
    return make_token("admin")


@pytest.fixture
def upload_token(make_token: Callable[..., str]) -> str:
    return make_token("upload")


@pytest.fixture
def read_token(make_token: Callable[..., str]) -> str:
    return make_token("read")


@pytest.fixture
def client(app: FastAPI, admin_token: str) -> Iterator[TestClient]:
    with TestClient(app, headers=bearer(admin_token)) as test_client:
        yield test_client


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# -- traces and uploads --------------------------------------------------------------------------


def small_trace_bytes() -> bytes:
    """A real (tiny, 3 KB) Kineto trace, gzip-compressed, as the agent would upload it."""
    path = FIXTURE_TRACES / "hta" / "critical_path" / "cuda_event_sync" / "event_sync_trace.json.gz"
    if not path.is_file():
        pytest.skip(f"fixture trace missing: {path}")
    return path.read_bytes()


def synthetic_trace(n_events: int = 10, *, compress: bool = True) -> bytes:
    """A minimal well-formed Chrome trace (not a realistic profile: only for transport tests)."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": f"aten::op{i}", "pid": 1, "tid": 1, "ts": i * 10, "dur": 5}
        for i in range(n_events)
    ]
    raw = json.dumps({"schemaVersion": 1, "traceEvents": events}).encode()
    return gzip.compress(raw, mtime=0) if compress else raw  # deterministic, as the agent writes it


def upload(
    client: TestClient | httpx.Client,
    body: bytes,
    *,
    token: str | None = None,
    project: str = "proj",
    run: str = "run1",
    rank: int | None = 0,
    idempotency_key: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    gzipped: bool = True,
    headers: Mapping[str, str] | None = None,
) -> httpx.Response:
    """POST a trace the way the agent does (upload protocol in the team brief)."""
    params: dict[str, Any] = {"project": project, "run": run}
    if rank is not None:
        params["rank"] = rank
    sent: dict[str, str] = {"Content-Type": "application/json"}
    if gzipped:
        sent["Content-Encoding"] = "gzip"
    if token is not None:
        sent.update(bearer(token))
    if idempotency_key is not None:
        sent["Idempotency-Key"] = idempotency_key
    if metadata is not None:
        sent["X-Stepdoctor-Metadata"] = json.dumps(dict(metadata), separators=(",", ":"))
    sent.update(headers or {})
    return client.post("/api/v1/traces", params=params, content=body, headers=sent)


def drain(app: FastAPI, worker_id: str = "test:1:0") -> int:
    """Run every queued job in this process, as one worker would; returns how many ran."""
    from stepdoctor_server.jobs.claims import SqlJobQueue
    from stepdoctor_server.jobs.pool import process_one

    db, n = app.state.db, 0
    queue = SqlJobQueue(db)
    while process_one(db, queue, app.state.store, app.state.settings, worker_id):
        n += 1
    return n


# -- state snapshots (for "nothing half-written" checks) -----------------------------------------


def row_counts(app: FastAPI) -> dict[str, int]:
    """Rows in every table of the schema."""
    with app.state.db.session() as session:
        return {
            table.name: int(session.scalar(select(func.count()).select_from(table)) or 0)
            for table in Base.metadata.sorted_tables
        }


def store_files(app: FastAPI) -> list[str]:
    """Every file under the trace store, temp files included."""
    return [str(p) for p in app.state.store.list_files()]


# -- a real server process -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def serve_subprocess(
    env: Mapping[str, str],
    *,
    port: int | None = None,
    timeout_s: float = 60.0,
    command: Sequence[str] = (sys.executable, "-m", "stepdoctor"),
    base_env: Mapping[str, str] | None = None,
    cwd: Path = REPO_ROOT,
) -> Iterator[ServerProcess]:
    """Run ``stepdoctor serve`` on 127.0.0.1 with ``env`` added; wait for /readyz; stop it after.

    ``command`` is how ``stepdoctor`` is started (another environment's console script, for the
    installed wheel) and ``base_env`` what ``env`` is added to (default: this process's).
    Output goes to a log file (a pipe nobody reads would fill up and block the server).
    """
    port = port or _free_port()
    log_path = Path(tempfile.mkstemp(prefix="stepdoctor-serve-", suffix=".log")[1])
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*command, "serve", "--host", "127.0.0.1", "--port", str(port)],
            env={**(os.environ if base_env is None else base_env), **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(cwd),
        )
    server = ServerProcess(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path)
    try:
        _wait_ready(server, timeout_s)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(server: ServerProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"stepdoctor serve exited with {server.process.returncode}:\n{server.output()}"
            )
        try:
            if httpx.get(f"{server.url}/readyz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"stepdoctor serve not ready after {timeout_s}s:\n{server.output()}")
        time.sleep(0.2)


def logged_in(app: FastAPI, token: str) -> TestClient:
    """A dashboard client logged in with ``token`` (the session cookie the login form sets)."""
    client = TestClient(app)
    resp = client.post(
        "/login",
        content=f"token={token}&next=/",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        follow_redirects=False,
    )
    assert resp.status_code == 303, resp.text
    return client


def cli_token(env: Mapping[str, str], scope: str) -> str:
    """An API token of the default team minted by the real CLI against the server's database in ``env``."""
    out = subprocess.run(
        [sys.executable, "-m", "stepdoctor", "token", "create", "--team", "default", "--scope", scope],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def migrated_sqlite_env(data_dir: Path) -> dict[str, str]:
    """Environment for ``serve_subprocess`` on a fresh SQLite database in ``data_dir`` (no workers),
    migrated by the real CLI (``stepdoctor db upgrade``) as an operator would."""
    env = {"STEPDOCTOR_DATA_DIR": str(data_dir), "STEPDOCTOR_DATABASE_URL": "", "STEPDOCTOR_WORKERS": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "stepdoctor", "db", "upgrade"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"stepdoctor db upgrade exited with {done.returncode}:\n{done.stderr}")
    return env


def store_analysis(
    app: FastAPI,
    trace_id: int,
    report: dict[str, Any],
    *,
    engine_version: str = ENGINE_VERSION,
    primary_kind: str | None = None,
    primary_share: float | None = None,
    duration_ms: int = 1,
) -> str:
    """Mark a trace done with this stored report, as a worker does after the engine, without
    running it; returns the trace's file name."""
    with app.state.db.session() as session:
        trace = session.get(Trace, trace_id)
        assert trace is not None
        trace.status = "done"
        session.add(
            Analysis(
                trace_id=trace_id,
                engine_version=engine_version,
                schema_version=SCHEMA_VERSION,
                primary_kind=primary_kind,
                primary_share=primary_share,
                report=report,
                duration_ms=duration_ms,
            )
        )
        return str(trace.filename)


@dataclass
class WorkerRun:
    """A ``stepdoctor worker`` process; ``output`` is its stdout and stderr once it has stopped."""

    process: subprocess.Popen[bytes]
    output: str = ""


@contextmanager
def worker_subprocess(database_url: str, data_dir: Path, *args: str) -> Iterator[WorkerRun]:
    """``stepdoctor worker *args`` on this database and data directory; on exit it gets SIGINT
    (an operator's Ctrl-C) and its output is kept, so the test can check how it stopped.

    Output goes to a file, as ``serve_subprocess``'s does: a pipe read only at the end fills up
    (64 KiB) once the worker has logged enough, e.g. working through many queued jobs, and the
    worker then blocks in its next log call, mid-job, until the test gives up.
    """
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "stepdoctor", "worker", *args],
            env={**os.environ, "STEPDOCTOR_DATABASE_URL": database_url, "STEPDOCTOR_DATA_DIR": str(data_dir)},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(REPO_ROOT),
        )
        run = WorkerRun(process)
        try:
            yield run
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            finally:
                log.seek(0)
                run.output = log.read().decode(errors="replace")
