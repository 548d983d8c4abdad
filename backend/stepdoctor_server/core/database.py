"""Engine, sessions and the request unit of work.

Services only ``flush``; the request-scoped session dependency commits on success and rolls back on
error, then runs the rollback hooks (e.g. deleting a trace file renamed into the store) so a failed
request leaves neither rows nor files behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from sqlalchemy import Engine, Select, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from stepdoctor_server.core.settings import Settings, get_settings

_ROLLBACK_HOOKS = "stepdoctor_on_rollback"


def make_engine(settings: Settings) -> Engine:
    """Create the engine; SQLite gets WAL, foreign keys and writer-serialising transactions."""
    url = make_url(settings.database_url.get_secret_value())
    if url.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)
    if url.database and url.database != ":memory:":
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url, connect_args={"check_same_thread": False, "timeout": settings.sqlite_busy_timeout_s}
    )
    _configure_sqlite(engine, settings)
    return engine


# Execution option marking a connection whose transactions only read (SQLite: plain BEGIN).
READ_ONLY = "stepdoctor_read_only"


def _configure_sqlite(engine: Engine, settings: Settings) -> None:
    """Take over pysqlite's transaction handling (needed for SAVEPOINT); writers begin IMMEDIATE.

    In WAL mode a deferred transaction that reads and then writes fails at once with "database is
    locked" when another writer committed in between; taking the write lock at BEGIN makes
    concurrent writers wait (up to the busy timeout) instead of failing. Readers (sessions made
    with ``read_only=True``: GET requests) begin deferred and never take the write lock, so a
    page answers from its WAL snapshot while another connection writes. Keep sessions short.
    """
    busy_ms = int(settings.sqlite_busy_timeout_s * 1000)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(READ_ONLY) else "BEGIN IMMEDIATE")


class AppSession(Session):
    """A session of this app's database; ``defers_jobs``: work queued in its transaction goes to a
    job engine's table (procrastinate) rather than being claimed from ``traces`` by the pool;
    ``settings``: the app's, for work done inside the unit of work (``settings_of``)."""

    def __init__(
        self, *args: Any, defers_jobs: bool = False, settings: Settings | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.defers_jobs = defers_jobs
        self.settings = settings


def settings_of(session: Session) -> Settings:
    """The settings of the app whose database ``session`` belongs to (the process's otherwise)."""
    found = session.settings if isinstance(session, AppSession) else None
    return found if found is not None else get_settings()


def defers_jobs(session: Session) -> bool:
    """Whether jobs queued in ``session``'s transaction are deferred to the job engine."""
    return isinstance(session, AppSession) and session.defers_jobs


class Database:
    """The engine and session factory of one app (tests build several side by side)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = make_engine(settings)
        # Sessions know whether their jobs are deferred to a job engine (``defers_jobs``).
        defer = settings.uses_procrastinate
        self.sessionmaker = sessionmaker(
            self.engine,
            class_=AppSession,
            expire_on_commit=False,
            defers_jobs=defer,
            settings=settings,
        )
        self.read_sessionmaker = sessionmaker(
            self.engine.execution_options(**{READ_ONLY: True}),
            class_=AppSession,
            expire_on_commit=False,
            defers_jobs=defer,
            settings=settings,
        )

    @contextmanager
    def session(self, *, read_only: bool = False) -> Iterator[Session]:
        """A unit of work outside a request (CLI, workers, auth): commit on success, else roll back.

        ``read_only`` sessions do not take SQLite's write lock (a write in one still works, but
        may fail with "database is locked" when another writer got there first).
        """
        factory = self.read_sessionmaker if read_only else self.sessionmaker
        with factory() as session:
            try:
                yield session
                session.commit()
                session.info.pop(_ROLLBACK_HOOKS, None)
            except BaseException:
                session.rollback()
                run_rollback_hooks(session)
                raise

    def ping(self) -> None:
        """Raise if the database cannot answer a trivial query."""
        with self.engine.connect().execution_options(**{READ_ONLY: True}) as conn:
            conn.exec_driver_sql("SELECT 1")
            conn.rollback()

    def dispose(self) -> None:
        self.engine.dispose()


def on_rollback(session: Session, hook: Callable[[], None]) -> None:
    """Run ``hook`` if this unit of work rolls back (undo side effects outside the database)."""
    session.info.setdefault(_ROLLBACK_HOOKS, []).append(hook)


def run_rollback_hooks(session: Session) -> None:
    hooks: list[Callable[[], None]] = session.info.pop(_ROLLBACK_HOOKS, [])
    for hook in reversed(hooks):
        try:
            hook()
        except Exception:  # a failing cleanup must not mask the original error
            continue


_Row = TypeVar("_Row")


def get_or_create(session: Session, query: Select[_Row], make: Callable[[], _Row]) -> _Row:
    """The row ``query`` finds, else ``make()``'s, added in a savepoint; when a concurrent creator
    wins the unique constraint, theirs. ``query`` must select by that unique key."""
    found = session.scalar(query)
    if found is not None:
        return found
    try:
        with session.begin_nested():
            row = make()
            session.add(row)
            session.flush()
    except IntegrityError:  # created concurrently (another upload, the same process's next chunk)
        row = session.scalars(query).one()
    return row


def get_db(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


DatabaseDep = Annotated[Database, Depends(get_db)]


def get_session(db: DatabaseDep, request: Request) -> Iterator[Session]:
    """Request unit of work; runs in the threadpool and finishes before the response is sent.

    GET and HEAD requests read: on SQLite they never wait for (nor block) a writer.
    """
    with db.session(read_only=request.method in ("GET", "HEAD")) as session:
        yield session


# scope="function": commit before the response goes out, so a 201 means the row is durable.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
