"""The parser's entry points: a trace file or stream -> ``RankTrace``, and a job's files in rank order.

Kept out of the package's ``__init__`` (which names them lazily) so that importing a light sibling,
such as ``parsing.logdir`` for ``stepdoctor analyze --help``, does not import numpy, msgspec and the
whole parser.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from ..errors import TraceError
from ..model.trace import RankTrace
from .assembly import assemble
from .columns import Builder
from .forking import Started
from .forking import start as start_forked
from .forking import start_trace as start_trace
from .reading import DEFAULT_MAX_BYTES, decompressed_blocks
from .splitting import StreamParser

__all__ = ["DEFAULT_MAX_BYTES", "job_files", "job_order", "load_job", "load_trace", "start_trace"]


def load_trace(
    path: str | Path | BinaryIO,
    *,
    max_bytes: int | None = None,
    name: str | None = None,
    workers: int = 1,
    started: Started | None = None,
) -> RankTrace:
    """Parse one rank's trace (``.json`` or gzip, detected by content) into a ``RankTrace``.

    ``path`` may also be a readable binary stream (an object-store reader), read once front to
    back, so a server worker needs no local copy. ``name`` labels it in messages and as the
    trace's source (default: the file name), so a server names what its users know, never a
    storage key.

    ``workers`` > 1: a large enough file is parsed by two processes where this one may fork
    (``forked``); the trace is the same, column for column. ``started``: the second process
    ``start_trace`` forked for this file, which is already parsing its share.
    """
    cap = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    if isinstance(path, str | Path):
        p = Path(path)
        if not p.is_file():
            raise TraceError(f"{p.name}: no such trace file")
        source: Path | BinaryIO = p
        label = name or p.name
        of = (p, cap, label, name or str(p))
        if started is None or started.of != of:  # another file's is the caller's to cancel
            started = start_forked(*of) if workers > 1 else None
        shared = started.finish() if started is not None else None
        if shared is not None:
            return assemble(shared)
        builder = Builder(name or str(p))
    else:
        source = path
        label = name or Path(str(getattr(path, "name", "") or "trace")).name
        builder = Builder(label)
    # Decompression runs inline: a producer thread lost more to GIL hand-offs than it overlapped
    # (measured 8-20% slower, from 2 MB to 800 MB traces, on 2 cores).
    blocks = decompressed_blocks(source, cap, label)
    try:
        StreamParser(builder, label).run(blocks)
    finally:
        blocks.close()  # closes the file at once, also when parsing failed
    return assemble(builder)


def load_job(
    path: str | Path, *, max_bytes: int | None = None, workers: int = 1, started: Started | None = None
) -> list[RankTrace]:
    """Parse a file, or a directory of per-rank ``.json``/``.json.gz`` files, sorted by rank."""
    p = Path(path)
    if p.is_file():
        return [load_trace(p, max_bytes=max_bytes, workers=workers, started=started)]
    traces = [load_trace(f, max_bytes=max_bytes, workers=workers) for f in job_files(p)]
    order = job_order([t.rank for t in traces])
    return [traces[i] for i in order]


def job_files(p: Path) -> list[Path]:
    """A directory's trace files, in name order (``load_job``; ``rank_pool`` reads them one each)."""
    if not p.is_dir():
        raise TraceError(f"{p.name}: no such trace file or directory")
    files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith((".json", ".json.gz")))
    if not files:
        raise TraceError(f"{p.name}: directory holds no .json or .json.gz trace files")
    return files


def job_order(ranks: list[int | None]) -> list[int]:
    """The job's traces in rank order (``distributedInfo``); traces without one keep their file order
    after ranked ones. ``ranks``: each file's rank, in file order; returns file indexes."""
    return sorted(range(len(ranks)), key=lambda i: (ranks[i] is None, ranks[i] or 0, i))
