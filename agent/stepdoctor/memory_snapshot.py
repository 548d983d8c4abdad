"""The CUDA allocator's history during a capture window: ``stepdoctor.profile(..., memory_snapshot=True)``.

While ``torch.cuda.memory._record_memory_history`` is on, the caching allocator records every
allocation and free with the Python and C++ stack that made it; ``torch.cuda.memory._snapshot()``
returns that history with the allocator's segments, the data torch's memory visualizer
(https://pytorch.org/memory_viz) reads. Each window's snapshot is pickled to
``SPOOL/<project>/<run>/memory_snapshots/<trace stem>.pickle``, beside the window's trace; the
delivery worker (and ``stepdoctor sync``) uploads it right after its trace, and the server keeps it
beside the trace for download (never unpickled there). It follows its trace into ``uploaded/``
(pruned with it under the spool cap) or ``failed/``.

Cost, which is why it is off by default and on only inside capture windows: every CUDA allocation
and free in the window captures its stack (a few µs each; a step making thousands of allocations
slows by several percent while recording), the history holds at most ``MAX_ENTRIES`` events, and
the pickle is typically tens of MB per window. Without CUDA (or a torch without the API) it is a
no-op. Nothing here may fail a training step: errors are logged once and the window goes on.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

from stepdoctor.guard import guarded, log_once
from stepdoctor.spool import SNAPSHOT_DIR, snapshot_path

__all__ = ["SNAPSHOT_DIR", "dump", "snapshot_path", "start", "stop"]

MAX_ENTRIES = 100_000  # events kept (torch's own visualizer examples use 100k)


def _memory_module() -> Any | None:
    """``torch.cuda.memory`` when CUDA is there and it can record the allocator's history."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    mem = torch.cuda.memory
    if not hasattr(mem, "_record_memory_history") or not hasattr(mem, "_snapshot"):
        log_once(
            "memory-snapshot-api", logging.WARNING, "stepdoctor: this torch cannot record memory snapshots"
        )
        return None
    return mem


@guarded(default=False)
def start(max_entries: int = MAX_ENTRIES) -> bool:
    """Start recording the allocator's history; False (and nothing done) without CUDA."""
    mem = _memory_module()
    if mem is None:
        return False
    mem._record_memory_history(max_entries=max_entries)
    return True


@guarded(default=None)
def dump(path: Path) -> Path | None:
    """Write the history recorded since ``start`` to ``path`` (pickled, as torch's visualizer reads it),
    then stop recording. None when nothing was recorded."""
    mem = _memory_module()
    if mem is None:
        return None
    try:
        snapshot = mem._snapshot()
    finally:
        stop()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as f:
        pickle.dump(snapshot, f)
    partial.replace(path)
    return path


@guarded(default=None)
def stop() -> None:
    """Stop recording (a no-op when not recording, or without CUDA)."""
    mem = _memory_module()
    if mem is not None:
        mem._record_memory_history(enabled=None)
