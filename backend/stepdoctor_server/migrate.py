"""Run the Alembic migrations from code (``stepdoctor db upgrade``, ``serve``, tests).

The schema exists only through migrations; the script location is the installed
``stepdoctor_migrations`` package, so this works from a wheel as well as from the checkout.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, pool
from sqlalchemy.engine import make_url

import stepdoctor_migrations
from stepdoctor_server.settings import Settings


def _engine(settings: Settings) -> Engine:
    """A throwaway engine; a SQLite file's directory is created so first runs just work."""
    url = make_url(settings.database_url)
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


def upgrade(settings: Settings, revision: str = "head") -> None:
    """Bring the database at ``settings.database_url`` to ``revision`` (creates a SQLite file if needed)."""
    config = alembic_config(settings.database_url)
    engine = _engine(settings)
    try:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
    finally:
        engine.dispose()


def current_revision(settings: Settings) -> str | None:
    """The revision the database is at (None for an empty database)."""
    from alembic.runtime.migration import MigrationContext

    engine = _engine(settings)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
