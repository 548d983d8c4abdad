"""A run's traces as a zipped TensorBoard log directory the torch-tb-profiler plugin loads as-is.

Layout (anchors §2): the plugin treats any folder holding ``(.*?)(\\.\\d+)?\\.pt\\.trace\\.json(\\.gz)?``
files as a run; the part before the dotted number is the *worker*, the number is the *span*.
We write one file per (rank, capture window):

    {run_name}/{host}_{rank}.{window:06d}.pt.trace.json.gz

- ``{host}_{rank}`` matches the plugin's ``^(.*)_(\\d+)`` node/process pattern, so its distributed
  view shows node = host and process = rank.
- The plugin orders spans by sorting the span *strings*, so the window index is zero-padded.
- Stored uploads are already gzip; they are stored in the zip uncompressed (no double work) and
  streamed chunk by chunk, so a multi-GB run never sits in memory.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

CHUNK = 1 << 20
GZIP_MAGIC = b"\x1f\x8b"
# torch-tb-profiler 0.4.3 consts.WORKER_PATTERN, mirrored so tests can check our names against it.
WORKER_PATTERN = re.compile(r"^(.*?)(\.\d+)?\.pt\.trace\.json(?:\.gz)?$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


class Openable(Protocol):
    """A stored trace that is not a local file (an object in S3): anything with ``open("rb")``."""

    def open(self, mode: str = "rb") -> IO[bytes]: ...


@dataclass(frozen=True)
class ExportItem:
    """One stored trace file and where it came from."""

    path: Path | Openable
    rank: int | None
    window_index: int | None
    host: str | None
    trace_id: int


def worker_name(host: str | None, rank: int | None, trace_id: int) -> str:
    """``{host}_{rank}``; without a rank, ``{host}_0``: a rank-less run is one process, so its capture
    windows (and repeated uploads) become spans of that one worker, as the plugin shows one process
    profiled several times. The ``_N`` suffix is what the plugin's ``NODE_PROCESS_PATTERN`` reads as
    the process. ``trace_id`` is unused now and kept for callers.

    Other characters than ``[A-Za-z0-9_-]`` in host names become ``-``: a dot would be read as the
    span separator.
    """
    node = _UNSAFE.sub("-", host).strip("-") if host else ""
    node = node or "node"
    return f"{node}_{rank if rank is not None else 0}"


def archive_names(run_name: str, items: Iterable[ExportItem]) -> list[tuple[str, Path | Openable]]:
    """Zip member name for each item; a rank's windows become the spans of one worker."""
    out: list[tuple[str, Path | Openable]] = []
    used: dict[str, set[int]] = {}
    for item in sorted(items, key=lambda i: (i.rank is None, i.rank or 0, i.window_index or 0, i.trace_id)):
        worker = worker_name(item.host, item.rank, item.trace_id)
        spans = used.setdefault(worker, set())
        span = item.window_index if item.window_index is not None and item.window_index >= 0 else 0
        if span in spans:  # two uploads of one window must not overwrite each other: next free span
            span = max(spans) + 1
        spans.add(span)
        suffix = ".pt.trace.json.gz" if _is_gzip(item.path) else ".pt.trace.json"
        out.append((f"{run_name}/{worker}.{span:06d}{suffix}", item.path))
    return out


def stream_zip(members: Iterable[tuple[str, Path | Openable]]) -> Iterator[bytes]:
    """Yield a zip archive of ``(name, file)`` pairs in ~1 MiB chunks, without seeking."""
    sink = _Sink()
    with zipfile.ZipFile(sink, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, path in members:
            with path.open("rb") as src, zf.open(name, mode="w", force_zip64=True) as dst:
                while chunk := src.read(CHUNK):
                    dst.write(chunk)
                    yield from sink.drain()
            yield from sink.drain()
    yield from sink.drain()


def _is_gzip(path: Path | Openable) -> bool:
    with path.open("rb") as fh:
        return fh.read(2) == GZIP_MAGIC


class _Sink:
    """Write-only, unseekable buffer: zipfile then writes data descriptors instead of seeking back."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None

    def drain(self) -> Iterator[bytes]:
        if self._parts:
            data = b"".join(self._parts)
            self._parts.clear()
            yield data
