"""Agent configuration: explicit arguments win, then ``STEPDOCTOR_*`` environment variables, then defaults.

Environment variables let a launcher (SLURM script, torchrun wrapper, CI) configure every rank
without touching the training code.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_BAD_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_TRUE = {"1", "true", "yes", "on"}


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def valid_name(name: str) -> bool:
    """Project/run names the server accepts: 1-128 chars of ``[A-Za-z0-9._-]``, not starting with '.'."""
    return bool(_NAME_RE.fullmatch(name))  # fullmatch: "$" would let a trailing newline through


def sanitize_name(name: str, fallback: str) -> str:
    """Turn any string into a name the server accepts, so a typo never costs a run's traces."""
    cleaned = _BAD_CHARS.sub("-", name.strip()).lstrip(".")[:128]
    return cleaned if valid_name(cleaned) else fallback


def default_spool() -> Path:
    """Per-user cache location, shared by runs so the next run (or ``stepdoctor sync``) finds leftovers."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "stepdoctor" / "spool"


def job_id() -> str | None:
    """The launcher's job id, shared by every rank of a job (torchrun sets 'none' when not given)."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(var, "").strip()
        if value and value.lower() != "none":
            return value
    return None


def default_run_name() -> str:
    """The job id when a launcher provides one (so all ranks agree), else script name + start time."""
    jid = job_id()
    if jid:
        return sanitize_name(f"job-{jid}", "run")
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c") else "python"
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return sanitize_name(f"{script}-{stamp}", f"run-{stamp}")


@dataclass(frozen=True)
class Schedule:
    """When to capture: skip ``skip_first`` steps, then cycles of wait/warmup/active steps.

    ``repeat=0`` cycles forever. ``every=N`` is a shorthand for periodic capture: one window every
    N steps (wait is derived from it) for as long as the loop runs.
    """

    skip_first: int = 10
    wait: int = 0
    warmup: int = 2
    active: int = 3
    repeat: int | None = None
    every: int | None = None

    def resolved(self) -> tuple[int, int, int, int, int]:
        """(skip_first, wait, warmup, active, repeat) as torch.profiler.schedule takes them.

        ``repeat`` defaults to one window, or to forever when ``every`` asks for periodic capture.
        """
        if self.every is None:
            return (
                self.skip_first,
                self.wait,
                self.warmup,
                self.active,
                1 if self.repeat is None else self.repeat,
            )
        cycle = self.warmup + self.active
        if self.every < cycle:
            raise ValueError(f"every={self.every} is shorter than warmup+active={cycle}")
        repeat = 0 if self.repeat is None else self.repeat
        return self.skip_first, self.every - cycle, self.warmup, self.active, repeat


#: Default spool cap: room for local copies of uploaded traces; unsent traces are never deleted for it.
SPOOL_MAX_BYTES = 1 << 30
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.I)


def parse_size(text: str) -> int:
    """Bytes from ``4e9``, ``500MB``, ``4GiB``, ``1024`` (decimal units, ``i`` for binary ones)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 500MB, 4GiB, 1e9)")
    number, unit, binary = match.groups()
    power = "kmgt".find(unit.lower()) + 1 if unit else 0
    return int(float(number) * (1024 if binary else 1000) ** power)


@dataclass(frozen=True)
class Delivery:
    """Upload tuning; tests shrink the timeouts and backoff to keep the suite fast.

    ``spool_max_bytes`` caps the spool: delivered traces stay as local copies under
    ``SPOOL/uploaded`` and the oldest go first when the spool outgrows it (0 keeps none).

    ``flush_timeout`` is what leaving ``profile()`` may cost a training script when the server is
    slow or hung (a refused connection ends the wait at once); what is not sent by then stays in
    the spool for the next run or ``stepdoctor sync``. ``connect_timeout`` bounds every connection,
    so a firewalled or dead host is known within seconds; ``http_timeout`` bounds each read/write.
    """

    flush_timeout: float = 2.0
    connect_timeout: float = 5.0
    http_timeout: float = 30.0
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    retry_after_max: float = 3600.0
    compresslevel: int = 1
    spool_max_bytes: int = SPOOL_MAX_BYTES


def default_flush_timeout() -> float:
    """Seconds the agent may spend delivering at exit (``STEPDOCTOR_FLUSH_TIMEOUT``, default 2)."""
    return float(os.environ.get("STEPDOCTOR_FLUSH_TIMEOUT") or Delivery.flush_timeout)


def default_spool_max_bytes() -> int:
    """``STEPDOCTOR_SPOOL_MAX_BYTES`` (sizes as written: ``2GiB``, ``500MB``), default 1 GiB."""
    value = os.environ.get("STEPDOCTOR_SPOOL_MAX_BYTES", "").strip()
    return parse_size(value) if value else SPOOL_MAX_BYTES


def ca_bundle() -> str | None:
    """CA certificates to trust for an ``https://`` server (a private CA): ``STEPDOCTOR_CA_BUNDLE``,
    else the variables requests and OpenSSL users already set on their clusters."""
    for var in ("STEPDOCTOR_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        value = os.environ.get(var, "").strip()
        if value:
            return os.path.expanduser(value)
    return None


@dataclass(frozen=True)
class AgentConfig:
    project: str
    run: str
    server: str | None
    token: str | None
    spool: Path
    disabled: bool = False
    tags: dict[str, str] = field(default_factory=dict)
    schedule: Schedule = field(default_factory=Schedule)
    delivery: Delivery = field(default_factory=Delivery)


def resolve(
    *,
    project: str | None = None,
    run: str | None = None,
    server: str | None = None,
    token: str | None = None,
    spool: str | os.PathLike[str] | None = None,
    disabled: bool | None = None,
    tags: dict[str, str] | None = None,
    schedule: Schedule | None = None,
    delivery: Delivery | None = None,
) -> AgentConfig:
    """Merge arguments with the environment into one immutable config."""
    env = os.environ
    server = server or env.get("STEPDOCTOR_SERVER") or None
    spool_path = Path(spool or env.get("STEPDOCTOR_SPOOL") or default_spool()).expanduser()
    return AgentConfig(
        project=sanitize_name(project or env.get("STEPDOCTOR_PROJECT") or "default", "default"),
        run=sanitize_name(run or env.get("STEPDOCTOR_RUN") or default_run_name(), "run"),
        server=server.rstrip("/") if server else None,
        token=token or env.get("STEPDOCTOR_TOKEN") or None,
        spool=spool_path,
        disabled=env_flag("STEPDOCTOR_DISABLED") if disabled is None else disabled,
        tags={str(k): str(v) for k, v in (tags or {}).items()},
        schedule=schedule or Schedule(),
        delivery=delivery or Delivery(),
    )
