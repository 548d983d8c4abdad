"""Server configuration: one pydantic-settings class read from ``STEPDOCTOR_*`` environment variables.

Embedded defaults make ``stepdoctor serve`` work with no configuration at all (a SQLite file and a
trace store under ``STEPDOCTOR_DATA_DIR``); ``STEPDOCTOR_DATABASE_URL`` switches to PostgreSQL.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

GiB = 1024**3


class Settings(BaseSettings):
    """Every knob of the service; tests build one directly instead of touching the environment."""

    model_config = SettingsConfigDict(env_prefix="STEPDOCTOR_", extra="ignore")

    data_dir: Path = Path("./stepdoctor-data")
    # Empty means "a SQLite file under data_dir"; filled in by the validator below.
    database_url: str = ""
    max_upload_bytes: int = Field(default=2 * GiB, gt=0)
    max_decompressed_bytes: int = Field(default=8 * GiB, gt=0)
    max_metadata_bytes: int = Field(default=8 * 1024, gt=0)
    # Analysis worker processes started by ``serve``; 0 leaves analysis to ``stepdoctor worker``.
    workers: int = Field(default=1, ge=0)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # SQLite waits this long for a competing writer before giving up with "database is locked".
    sqlite_busy_timeout_s: float = Field(default=30.0, gt=0)
    # Slow clients (timeouts.py): request headers due within this many seconds of connecting; each
    # body read must bring data within body_read_timeout_s and, after that, average at least
    # body_min_rate_bytes_s; one client address may hold max_connections_per_client connections
    # (0 = no limit; behind a reverse proxy all clients share its address).
    header_timeout_s: float = Field(default=10.0, ge=0)
    body_read_timeout_s: float = Field(default=30.0, ge=0)
    body_min_rate_bytes_s: float = Field(default=1024.0, ge=0)
    max_connections_per_client: int = Field(default=64, ge=0)

    @model_validator(mode="after")
    def _resolve_paths(self) -> Settings:
        self.data_dir = self.data_dir.expanduser().resolve()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'stepdoctor.sqlite3'}"
        return self

    @property
    def traces_dir(self) -> Path:
        """Root of the trace store (original uploaded bytes, keyed by storage key)."""
        return self.data_dir / "traces"

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings from the environment; tests call ``get_settings.cache_clear()``."""
    return Settings()
