"""Read back what an offline W&B run recorded (``WANDB_MODE=offline``): its ``run-*.wandb`` file.

The file is W&B's record log: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of
chunks, each with a 7-byte header (CRC32, length, type: 1 full, 2 first, 3 middle, 4 last) and
part of a protobuf ``wandb.proto.wandb_internal_pb2.Record``. wandb 0.31 ships no Python reader
for it (its service writes it), so the tests parse it here with wandb's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, LAST = 1, 4


def records(path: Path) -> list[Any]:
    """The ``Record`` messages of one ``run-*.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pos, pending = [], HEADER, b""
    while pos + HEADER <= len(raw):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + HEADER])
        pending += raw[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def finished(run_dir: Path, timeout_s: float = 120.0) -> list[Any]:
    """The run's records once its ``exit`` record is on disk: ``run.finish()`` can return before
    wandb's service process has written the file out."""
    from google.protobuf.message import DecodeError  # wandb's own dependency

    (path,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = records(path)
        except DecodeError:  # a chunk still being written
            found = []
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def summary(run_dir: Path) -> dict[str, Any]:
    """The run's summary as its last updates left it (``key -> value``)."""
    values: dict[str, Any] = {}
    for record in finished(run_dir):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                values[item.key] = json.loads(item.value_json)
    return values


def summary_updates(run_dir: Path, key: str) -> list[Any]:
    """Every value ``key`` was given, in order (one per logged window, for stepdoctor's keys)."""
    return [
        json.loads(item.value_json)
        for record in finished(run_dir)
        if record.WhichOneof("record_type") == "summary"
        for item in record.summary.update
        if item.key == key
    ]
