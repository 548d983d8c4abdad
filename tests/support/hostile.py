"""Traces and upload metadata whose every free-text field is an attack on the pages that show it.

An upload-scope token (the one every training job holds) can put any text into event names, kernel
names, the GPU's name, tags, hostnames and command lines; admins then open the pages that show it.
Each payload tries a different way out of its HTML context: closing the ``<script>`` element a
figure's JSON sits in, an element with an event handler, a ``javascript:`` link, and the two line
terminators that ended JavaScript strings before ES2019. Every payload that runs sets
``window.__xss`` and opens a dialog, so a browser test sees it either way.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from support.synthetic import TraceBuilder

SCRIPT_CLOSE = "</script><script>window.__xss=1;alert(1)</script>"
IMG_ONERROR = '<img src=x onerror="window.__xss=2;alert(2)">'
JS_URL = 'javascript:window.__xss=3//<a href="javascript:window.__xss=3;alert(3)">j</a>'
LINE_SEPARATORS = "a\u2028b\u2029c</script ><!--<script>window.__xss=4</script>"
PAYLOADS = (SCRIPT_CLOSE, IMG_ONERROR, JS_URL, LINE_SEPARATORS)

KERNELS = tuple(f"k{i}{p}" for i, p in enumerate(PAYLOADS))  # kernel names, each a payload
OPS = tuple(f"aten::op{i}{p}" for i, p in enumerate(PAYLOADS))  # the host ops that launch them
DEVICE = f"GPU {IMG_ONERROR}"  # deviceProperties' name: the device summary shows it


def hostile_trace(path: Path, *, device: str = DEVICE, steps: int = 3) -> Path:
    """A CUDA-shaped trace (ProfilerStep markers, launches, kernels) named by the payloads."""
    b = TraceBuilder(device_name=device)
    b.events.append(
        {"ph": "M", "name": "thread_name", "pid": 4242, "tid": 4242, "args": {"name": SCRIPT_CLOSE}}
    )
    t = 100.0
    for n in range(steps):
        start = t
        b.annotation(f"enumerate(DataLoader){IMG_ONERROR}", t, 30)
        t += 30
        for _ in range(20):
            for op, kernel in zip(OPS, KERNELS, strict=True):
                b.cpu_op(op, t, 20)
                b.launch(kernel, t + 5, 8, t + 15, 30)
                t += 40
        b.step(n + 1, start, t + 10 - start)
        t += 20
    return b.write(path)


def hostile_metadata(*, devices: str = DEVICE, batch_size: str = SCRIPT_CLOSE) -> dict[str, Any]:
    """The agent's upload metadata with the payloads in tags, hostname, command line and the
    fields the compare page quotes when two runs differ (device names, batch size)."""
    return {
        "tags": [f"t{i}{p}" for i, p in enumerate(PAYLOADS)],
        "host": IMG_ONERROR,
        "hostname": SCRIPT_CLOSE,
        "argv": ["train.py", SCRIPT_CLOSE, IMG_ONERROR, JS_URL, LINE_SEPARATORS],
        "cwd": LINE_SEPARATORS,
        "devices": [{"name": devices}],
        "loader": {"batch_size": batch_size},
    }


def gzipped(path: Path) -> bytes:
    """The trace's bytes as the agent uploads them (gzip), whatever ``path``'s suffix."""
    data = path.read_bytes()
    return data if data[:2] == b"\x1f\x8b" else gzip.compress(data, mtime=0)


def as_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
