"""torch's memory timeline as the agent embeds it in a trace (``stepdoctor.memory_timeline``).

The agent adds the top-level key ``stepdoctorMemoryTimeline``: ``{"format": 1, "device": "cpu",
"t_us": [...], "columns": {"PARAMETER": [...], ...}}``, times in torch's µs (the trace's ``ts``
plus ``baseTimeNanoseconds`` / 1000 where Kineto writes relative times). Anything else under that
key (another format, columns of another length, negative bytes) is ignored: the engine then
infers the categories, as for any trace without one.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from ..model.trace import TorchMemoryTimeline

KEY = "stepdoctorMemoryTimeline"
FORMAT = 1


class _Doc(msgspec.Struct):
    format: int
    device: str
    t_us: list[int]
    columns: dict[str, list[int]]


def read(value: Any, base_ns: Any) -> TorchMemoryTimeline | None:
    """The embedded timeline on the trace's ns clock, or None when there is none or it is unusable."""
    if value is None:
        return None
    try:
        doc = msgspec.convert(value, _Doc)
    except msgspec.ValidationError:
        return None
    n = len(doc.t_us)
    if doc.format != FORMAT or n == 0 or any(len(c) != n for c in doc.columns.values()):
        return None
    ts = np.asarray(doc.t_us, np.int64) * 1000 - (int(base_ns) if isinstance(base_ns, int) else 0)
    names = tuple(doc.columns)
    sizes = np.array([doc.columns[c] for c in names], np.int64).reshape(len(names), n).T
    if (np.diff(ts) < 0).any() or (sizes < 0).any():
        return None
    return TorchMemoryTimeline(device=doc.device, ts=ts, categories=names, bytes=sizes)
