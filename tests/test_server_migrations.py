"""The schema exists only through migrations, and the models agree with them."""

from __future__ import annotations

from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, pool

from stepdoctor_server.core import migrate
from stepdoctor_server.core.models import Base
from stepdoctor_server.core.settings import Settings


def test_models_and_migrations_agree(db_url: str) -> None:
    """Alembic autogenerate finds no difference between the migrated database and the models."""
    engine = create_engine(db_url, poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            opts = {"compare_type": True, "include_name": migrate.include_name}
            context = MigrationContext.configure(connection, opts=opts)
            assert compare_metadata(context, Base.metadata) == []
            assert set(inspect(connection).get_table_names()) >= {t.name for t in Base.metadata.sorted_tables}
    finally:
        engine.dispose()


def test_database_is_at_the_single_head(db_url: str, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, database_url=db_url)
    script = ScriptDirectory.from_config(migrate.alembic_config(db_url))
    assert len(script.get_heads()) == 1
    assert migrate.current_revision(settings) == script.get_current_head()


def test_upgrade_builds_an_empty_sqlite_database_and_is_idempotent(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "fresh")
    assert migrate.current_revision(settings) is None
    migrate.upgrade(settings)
    migrate.upgrade(settings)
    engine = create_engine(settings.database_url.get_secret_value(), poolclass=pool.NullPool)
    try:
        assert {"teams", "tokens", "projects", "runs", "traces", "analyses"} <= set(
            inspect(engine).get_table_names()
        )
    finally:
        engine.dispose()
    assert (tmp_path / "fresh" / "stepdoctor.sqlite3").is_file()
