"""torch's memory timeline inside each window's trace: ``stepdoctor.profile(..., memory_timeline=True)``.

torch's memory profiler (``torch.profiler._memory_profiler``) labels every tensor of a recorded
window by walking the autograd graph in the live process: parameters, optimizer state, inputs,
temporaries, activations, gradients, autograd internals. A trace file keeps only the allocator's
events, so the engine otherwise infers those categories from when each block lives; with this
option it reads torch's own labels instead.

At the end of a window, ``prof.export_memory_timeline(path, device=...)`` (its JSON flavour:
``[times_us, [bytes per category]]``) is written to a scratch file in the spool, compacted to at
most ``MAX_POINTS`` instants (each stretch's highest total kept, so the peak is exact) and added to
the exported trace as the top-level key ``stepdoctorMemoryTimeline``: the timeline travels with
the trace (spool, upload, ``stepdoctor analyze``, downloads) and viewers ignore the extra key. It
holds per-category columns, not rows, so the trace's tail keeps a handful of ``]`` (the engine's
splitter finds the end of ``traceEvents`` among the last ones).

Cost, which is why it is off by default: torch needs ``profile_memory``, ``record_shapes`` and
``with_stack`` on (so this option turns them on; stacks make the trace larger and each op slower to
record), and building the timeline runs in Python on the training thread when the window
ends: about 0.5 s for a 3-step window of a small MLP on CPU, growing with the number of ops and
tensors in the window (not measured on a large model: time one window before leaving it on). The embedded timeline adds at most
about 150 KB to the trace (25 KB for a 2-step window of a 32-layer MLP). torch deprecates ``export_memory_timeline`` in favour of CUDA memory snapshots
(``memory_snapshot=True``); where it is gone, or fails, the window is kept without a timeline and
the engine infers the categories, as without the option.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

from stepdoctor.guard import guarded, log_once

KEY = "stepdoctorMemoryTimeline"  # the engine's ``parsing.memory_timeline.KEY``
FORMAT = 1
MAX_POINTS = 2000
#: torch 2.x's column order after the leading zero column (``_memory_profiler._CATEGORY_TO_INDEX``).
TORCH_CATEGORIES = (
    "PARAMETER",
    "OPTIMIZER_STATE",
    "INPUT",
    "TEMPORARY",
    "ACTIVATION",
    "GRADIENT",
    "AUTOGRAD_DETAIL",
    "UNKNOWN",
)


def device_of(activities: Any) -> str:
    """The device whose memory the timeline follows: the current CUDA device when CUDA is recorded,
    else the host."""
    import torch

    if torch.cuda.is_available() and "CUDA" in str(activities):
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def torch_categories() -> tuple[str, ...]:
    """Column names of this torch's timeline (``None``, torch's uncategorised, as ``UNKNOWN``)."""
    try:
        from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX
    except ImportError:
        return TORCH_CATEGORIES
    ordered = sorted(_CATEGORY_TO_INDEX.items(), key=lambda kv: kv[1])
    return tuple(c.name if c is not None else "UNKNOWN" for c, _ in ordered)


@guarded(default=None)
def embed(prof: Any, trace: Path, device: str) -> dict[str, Any] | None:
    """Export the window's memory timeline and add it to ``trace`` (torch's finished export);
    returns what was added, or None when this torch cannot export one."""
    if not hasattr(prof, "export_memory_timeline"):
        log_once(
            "memory-timeline-api", logging.WARNING, "stepdoctor: this torch cannot export a memory timeline"
        )
        return None
    scratch = trace.with_name(f"{trace.name}.memory_timeline.{os.getpid()}.json")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of snapshots (docstring)
            prof.export_memory_timeline(str(scratch), device=device)
        with open(scratch, "rb") as fh:
            times, sizes = json.load(fh)
    finally:
        scratch.unlink(missing_ok=True)
    if not times:
        return None  # nothing recorded on that device
    doc = compact(times, sizes, torch_categories(), device)
    append_key(trace, KEY, doc)
    return doc


def compact(
    times: list[int],
    sizes: list[list[int]],
    names: tuple[str, ...],
    device: str,
    max_points: int = MAX_POINTS,
) -> dict[str, Any]:
    """torch's ``[times, sizes]`` as per-category columns at <= ``max_points`` instants: each of
    ``max_points`` equal stretches of time keeps its highest total, so the peak survives."""
    rows = [row[1:] if len(row) == len(names) + 1 else row for row in sizes]  # torch's leading zero column
    keep = list(range(len(times)))
    if len(times) > max_points:
        lo, span = times[0], max(1, times[-1] - times[0])
        best: dict[int, int] = {}
        for i, t in enumerate(times):
            bucket = (t - lo) * (max_points - 1) // span
            if bucket not in best or sum(rows[i]) > sum(rows[best[bucket]]):
                best[bucket] = i
        keep = sorted(best.values())
    columns = {
        name: [int(rows[i][k]) for i in keep]
        for k, name in enumerate(names[: len(rows[0]) if rows else 0])
        if any(rows[i][k] for i in keep)
    }
    return {
        "format": FORMAT,
        "source": "torch.profiler.profile.export_memory_timeline",
        "device": device,
        "t_us": [int(times[i]) for i in keep],
        "columns": columns,
    }


def append_key(trace: Path, key: str, value: Any) -> None:
    """Add ``"key": value`` to the JSON object in ``trace`` just before its closing brace (no rewrite
    of the file: torch's export may be GBs)."""
    payload = (f',"{key}":' + json.dumps(value, separators=(",", ":")) + "}").encode()
    with open(trace, "r+b") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - 256))
        tail = fh.read()
        end = tail.rstrip().rfind(b"}")
        if end < 0:
            raise ValueError(f"{trace.name} does not end with a JSON object")
        fh.seek(size - len(tail) + end)
        try:
            fh.write(payload)
            fh.truncate()
        except OSError:  # a full disk: put the original end back, the trace stays as torch wrote it
            fh.seek(size - len(tail))
            fh.write(tail)
            fh.truncate()
            raise
