"""Run the Alembic migrations from code (``stepdoctor db upgrade``, ``serve``, tests).

The schema exists only through migrations; the script location is the installed
``stepdoctor_migrations`` package, so this works from a wheel as well as from the checkout.

On PostgreSQL the upgrade holds a transaction-level advisory lock, so replicas started together
run it once (the others wait, then find the database at head), and it installs procrastinate's
schema (its own tables and functions, kept out of our models: ``include_name`` hides them from
Alembic's comparisons) in the same transaction.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, pool
from sqlalchemy.engine import make_url

import stepdoctor_migrations
from stepdoctor_server.core.settings import Settings


def _engine(settings: Settings) -> Engine:
    """A throwaway engine; a SQLite file's directory is created so first runs just work."""
    url = make_url(settings.database_url.get_secret_value())
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    return create_engine(url, poolclass=pool.NullPool)


def alembic_config(database_url: str) -> Config:
    """An in-memory Alembic config pointing at our migrations and ``database_url``."""
    config = Config()
    config.set_main_option("script_location", str(Path(stepdoctor_migrations.__file__).parent))
    # ConfigParser interpolation would choke on '%' in passwords.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


# pg_advisory_xact_lock key: "stepdoctor" in ASCII, so other applications' locks never collide.
ADVISORY_LOCK_KEY = 0x73746570646F63


def include_name(name: str | None, type_: str, _parent: object = None) -> bool:
    """Alembic filter: procrastinate's tables are not ours to compare or drop."""
    return not (type_ == "table" and (name or "").startswith("procrastinate_"))


def upgrade(settings: Settings, revision: str = "head") -> None:
    """Bring the database at ``settings.database_url`` to ``revision`` (creates a SQLite file if needed)."""
    config = alembic_config(settings.database_url.get_secret_value())
    engine = _engine(settings)
    try:
        with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({ADVISORY_LOCK_KEY})")
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
            if connection.dialect.name == "postgresql" and settings.uses_procrastinate:
                _install_procrastinate(connection)
    finally:
        engine.dispose()


def _install_procrastinate(connection: Connection) -> None:
    """Apply procrastinate's schema once (a database that already has it is left as is)."""
    exists = connection.exec_driver_sql("SELECT to_regclass('procrastinate_jobs') IS NOT NULL").scalar()
    if exists:
        return
    from procrastinate.schema import SchemaManager

    # Through the driver without parameters: the schema's comments hold literal '%' characters.
    with connection.connection.dbapi_connection.cursor() as cursor:  # type: ignore[union-attr]
        cursor.execute(SchemaManager.get_schema())


def procrastinate_installed(settings: Settings) -> bool:
    engine = _engine(settings)
    try:
        with engine.connect() as connection:
            return bool(
                connection.exec_driver_sql("SELECT to_regclass('procrastinate_jobs') IS NOT NULL").scalar()
            )
    finally:
        engine.dispose()


def is_current(settings: Settings) -> bool:
    """Whether the database is at the latest revision (API replicas check, never migrate)."""
    script = ScriptDirectory.from_config(alembic_config(settings.database_url.get_secret_value()))
    return current_revision(settings) == script.get_current_head()


def current_revision(settings: Settings) -> str | None:
    """The revision the database is at (None for an empty database)."""
    from alembic.runtime.migration import MigrationContext

    engine = _engine(settings)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
