"""Server configuration: one pydantic-settings class read from ``STEPDOCTOR_*`` environment variables.

Embedded defaults make ``stepdoctor serve`` work with no configuration at all (a SQLite file and a
trace store under ``STEPDOCTOR_DATA_DIR``); ``STEPDOCTOR_DATABASE_URL`` switches to PostgreSQL.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_serializer, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

GiB = 1024**3


class Settings(BaseSettings):
    """Every knob of the service; tests build one directly instead of touching the environment."""

    model_config = SettingsConfigDict(env_prefix="STEPDOCTOR_", extra="ignore")

    data_dir: Path = Path("./stepdoctor-data")
    # Empty means "a SQLite file under data_dir"; filled in by the validator below. A secret (it may
    # hold a password): repr and str show asterisks, messages print ``database_url_shown``.
    database_url: SecretStr = SecretStr("")
    max_upload_bytes: int = Field(default=2 * GiB, gt=0)
    max_decompressed_bytes: int = Field(default=8 * GiB, gt=0)
    max_metadata_bytes: int = Field(default=8 * 1024, gt=0)
    # A run accepts at most this many distinct ranks, and this many traces (capture windows) per rank;
    # and (ranks × windows) traces in all. Past a limit an upload is refused with 409 naming it.
    max_run_ranks: int = Field(default=4096, gt=0)
    max_run_windows: int = Field(default=16, gt=0)
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
    # ``serve`` exits within this long of SIGTERM/Ctrl-C: requests and analyses still running then
    # are abandoned (an abandoned upload keeps nothing; an analysis is requeued at the next start).
    shutdown_grace_s: float = Field(default=2.0, ge=0)
    # Trace store: empty = data_dir/traces; ``s3://bucket/prefix`` = S3 (AWS_* variables, AWS_ENDPOINT_URL).
    storage_url: str = ""
    # S3 only: downloads redirect to a presigned URL (the browser must reach the endpoint).
    storage_presign_downloads: bool = False
    # Job engine: ``auto`` = procrastinate on PostgreSQL, the in-process pool on SQLite.
    job_engine: Literal["auto", "embedded", "procrastinate"] = "auto"
    # An analysis whose trace store (or database) was unreachable is tried this many times in all,
    # waiting analysis_retry_wait_s, then twice as long each time (at most 5 min), before it fails.
    analysis_tries: int = Field(default=6, ge=1)
    analysis_retry_wait_s: float = Field(default=5.0, ge=0)
    # Per-job limits: an analysis past them is killed and fails with the limit as its reason.
    job_timeout_s: float = Field(default=1800.0, gt=0)
    job_memory_limit_bytes: int = Field(default=16 * GiB, ge=0)  # 0 = no limit
    # A worker silent this long is presumed dead and its jobs run elsewhere (issue: within 60 s).
    worker_stalled_after_s: float = Field(default=30.0, gt=0)
    worker_heartbeat_s: float = Field(default=5.0, gt=0)
    # Procrastinate workers learn of new jobs by NOTIFY; a job due later (a retry after an outage,
    # a stalled worker's job put back) is found by polling this often.
    job_poll_interval_s: float = Field(default=5.0, gt=0)
    # Prometheus metrics of ``stepdoctor worker`` (0 = off), bound to metrics_host.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    # Step series (runs/series.py): a chunk's size limit (the engine's own is 16 MiB; the agent's
    # chunks are ~40 KB), how long without a heartbeat (and no clean exit) a run is "stopped", and
    # how often the kept run timeline the run page and API show is redone (by the workers' sweep,
    # ``runs.series.refresh_run_timelines``; a GET never writes it) while chunks keep arriving (0: the
    # page and API answer the current one, computed without keeping it while the kept one is behind).
    max_series_chunk_bytes: int = Field(default=16 * 1024**2, gt=0)
    series_stale_after_s: float = Field(default=300.0, gt=0)
    run_timeline_refresh_s: float = Field(default=30.0, ge=0)
    # Regressions (runs.regressions): a run is compared with its project's chosen baseline run, else
    # with the median of the project's last ``baseline_runs`` finished runs; a steady step time more
    # than ``regression_threshold`` (a fraction: 0.05 = 5%) slower, or another verdict kind, is flagged.
    baseline_runs: int = Field(default=5, ge=1, le=100)
    regression_threshold: float = Field(default=0.05, ge=0, le=100)
    # One JSON POST per new regression (Slack/Mattermost-compatible ``text``), off the request path,
    # tried ``webhook_tries`` times with exponential backoff from ``webhook_retry_wait_s``. A secret
    # (the URL often embeds a token): repr, str and logs show only its scheme and host.
    webhook_url: SecretStr = SecretStr("")
    webhook_timeout_s: float = Field(default=10.0, gt=0, le=300)
    webhook_tries: int = Field(default=6, ge=1, le=50)
    webhook_retry_wait_s: float = Field(default=5.0, ge=0)
    # The dashboard's address as users reach it (``https://stepdoctor.example.com``), for links in
    # webhooks; empty: links are relative paths.
    public_url: str = ""

    @model_validator(mode="after")
    def _resolve_paths(self) -> Settings:
        self.data_dir = self.data_dir.expanduser().resolve()
        if not self.database_url.get_secret_value():
            self.database_url = SecretStr(f"sqlite:///{self.data_dir / 'stepdoctor.sqlite3'}")
        return self

    @field_serializer("database_url", "webhook_url", when_used="json")
    def _database_url_json(self, value: SecretStr) -> str:
        """Settings reach analysis child processes as JSON (``model_dump_json``), which must carry
        the real URL; Python dumps, repr and str keep it masked."""
        return value.get_secret_value()

    @property
    def webhook_url_shown(self) -> str:
        """The webhook URL for messages and logs: scheme and host only (its path is often the secret)."""
        from urllib.parse import urlsplit

        parts = urlsplit(self.webhook_url.get_secret_value())
        return f"{parts.scheme}://{parts.hostname or ''}/..." if parts.scheme else ""

    @property
    def database_url_shown(self) -> str:
        """The database URL with its password masked, for messages and logs."""
        from sqlalchemy.engine import make_url

        return make_url(self.database_url.get_secret_value()).render_as_string(hide_password=True)

    @property
    def traces_dir(self) -> Path:
        """Root of the trace store (original uploaded bytes, keyed by storage key)."""
        return self.data_dir / "traces"

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.get_secret_value().startswith("sqlite")

    @property
    def uses_procrastinate(self) -> bool:
        """Whether jobs go through procrastinate (PostgreSQL) rather than the in-process pool."""
        if self.job_engine == "auto":
            return self.database_url.get_secret_value().startswith("postgresql")
        return self.job_engine == "procrastinate"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings from the environment; tests call ``get_settings.cache_clear()``."""
    return Settings()
