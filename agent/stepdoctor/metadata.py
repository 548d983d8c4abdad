"""Run metadata recorded with every trace: what ran, where, and with which input pipeline.

The diagnosis needs context the trace lacks (a DataLoader's num_workers, the CPU count, the rank),
so it is gathered once at start, cheaply, and never by spawning processes in the training job.
"""

from __future__ import annotations

import os
import platform
import re
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stepdoctor.config import job_id
from stepdoctor.version import __version__

_SECRET_FLAG = re.compile(r"^-{1,2}[\w-]*(token|password|passwd|secret|api[-_]?key|credential)[\w-]*$", re.I)
LOADER_FIELDS = ("batch_size", "num_workers", "pin_memory", "prefetch_factor", "persistent_workers")


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def rank_info() -> dict[str, int | None]:
    """Rank, local rank and world size: torch.distributed when initialised, else launcher env vars."""
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # a broken distributed setup must not hide the env fallback
        pass
    local = _env_int("LOCAL_RANK")
    if local is None:
        local = _env_int("SLURM_LOCALID")
    if rank is None:
        rank = _env_int("SLURM_PROCID")
    return {"rank": rank, "local_rank": local, "world_size": world}


def torch_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": None,
        "device_count": 0,
        "devices": [],
    }
    try:
        if torch.backends.cudnn.is_available():
            info["cudnn"] = torch.backends.cudnn.version()
    except Exception:
        pass
    if torch.cuda.is_available():
        info["device_count"] = torch.cuda.device_count()
        for index in range(info["device_count"]):
            props = torch.cuda.get_device_properties(index)
            info["devices"].append(
                {
                    "index": index,
                    "name": props.name,
                    "total_memory": int(props.total_memory),
                    "capability": f"{props.major}.{props.minor}",
                }
            )
    return info


def git_commit(start: Path | None = None) -> str | None:
    """HEAD of the working directory's repository, read from .git files (no subprocess)."""
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        dotgit = directory / ".git"
        if dotgit.is_file():  # worktree / submodule: "gitdir: PATH"
            text = dotgit.read_text().strip()
            if not text.startswith("gitdir:"):
                return None
            dotgit = (directory / text.split(":", 1)[1].strip()).resolve()
        if dotgit.is_dir():
            return _resolve_head(dotgit)
    return None


def _resolve_head(gitdir: Path) -> str | None:
    head = (gitdir / "HEAD").read_text().strip()
    if not head.startswith("ref:"):
        return head or None
    ref = head.split(":", 1)[1].strip()
    common = gitdir
    commondir = gitdir / "commondir"
    if commondir.is_file():
        common = (gitdir / commondir.read_text().strip()).resolve()
    for base in (gitdir, common):
        ref_file = base / ref
        if ref_file.is_file():
            return ref_file.read_text().strip() or None
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref:
                return parts[0]
    return None


def redacted_argv(argv: list[str]) -> list[str]:
    """The command line with secret-looking option values masked: it travels to a shared server."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("***")
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if _SECRET_FLAG.match(flag):
            if eq:
                out.append(f"{flag}=***")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(arg)
    return out


def loader_settings(loader: Any) -> dict[str, Any]:
    """The DataLoader knobs the input-bound diagnosis reasons about (None where absent).

    ``loader`` is the DataLoader itself, or a mapping of the settings a framework knows (its
    ``type`` key names the loader class)."""
    settings: dict[str, Any] = {}
    known = isinstance(loader, Mapping)
    for name in LOADER_FIELDS:
        value = loader.get(name) if known else getattr(loader, name, None)
        settings[name] = value if isinstance(value, (int, float, bool, str, type(None))) else str(value)
    settings["type"] = str(loader.get("type", "DataLoader")) if known else type(loader).__name__
    return settings


def collect(tags: dict[str, str], loader: Any | None = None) -> dict[str, Any]:
    """Everything static about this process, gathered once when profiling starts."""
    meta: dict[str, Any] = {
        "agent_version": __version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "cpu_count": os.cpu_count(),
        "cpu_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "job_id": job_id(),
        "argv": redacted_argv(list(sys.argv)),
        "cwd": os.getcwd(),
        "tags": dict(tags),
    }
    try:
        meta["git_commit"] = git_commit()
    except OSError:
        meta["git_commit"] = None
    meta.update(torch_info())
    meta.update(rank_info())
    meta["loader"] = loader_settings(loader) if loader is not None else None
    return meta
