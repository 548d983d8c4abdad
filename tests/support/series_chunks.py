"""Step-series chunks built with the agent's own encoder, for the server's series tests."""

from __future__ import annotations

import array
import json
import struct
import time
import zlib
from typing import Any

from stepdoctor.series import MAGIC, encode_chunk


def chunk(
    stream: str,
    seq: int,
    first: int,
    count: int,
    *,
    wall_ms: float = 20.0,
    final: bool = False,
    t_end: float | None = None,
    rank: int | None = 0,
    profiled: list[list[int]] | None = None,
    windows: list[dict[str, Any]] | None = None,
    mem_steps: list[int] | None = None,
    slow: dict[int, float] | None = None,
) -> bytes:
    """One chunk of ``count`` steps from step ``first``, every step ``wall_ms`` long (a few slower;
    ``slow`` maps step numbers to their own length in ms)."""
    walls = [int(wall_ms * 1e6) + (i % 7) * 10_000 for i in range(count)]
    for step, ms in (slow or {}).items():
        walls[step - first] = int(ms * 1e6)
    mem = [first] if count and mem_steps is None else (mem_steps or [])
    header = {
        "project": "proj",
        "run": "run1",
        "format": 1,
        "kind": "stepdoctor.series",
        "stream": stream,
        "seq": seq,
        "rank": rank,
        "first_step": first,
        "count": count,
        "t_end": time.time() if t_end is None else t_end,
        "final": final,
        "anomaly": {"k": 1.5, "window": 50, "warmup": 50, "min_ms": 1.0},
        "profiled": profiled or [],
        "windows": windows or [],
        "anomalies": [],
    }
    columns = [
        ("wall_ns", array.array("q", walls)),
        ("data_ns", array.array("q", [1_000_000] * count)),
        ("mem_step", array.array("q", mem)),
        ("mem_kind", array.array("q", [0] * len(mem))),
        ("mem_a", array.array("q", [1 << 30] * len(mem))),
        ("mem_b", array.array("q", [-1] * len(mem))),
    ]
    return encode_chunk(header, columns)


def with_header(data: bytes, **changes: Any) -> bytes:
    """``data`` with header fields replaced, written as Python's json writes them (NaN included)."""
    (length,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    header = json.loads(data[start : start + length])
    header.update(changes)
    head = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + data[start + length :]


def padded(data: bytes, size: int) -> bytes:
    """A valid-looking chunk body grown past ``size`` bytes (incompressible padding after it)."""
    return data + zlib.compress(b"") + b"\0" * max(0, size - len(data) + 1)
