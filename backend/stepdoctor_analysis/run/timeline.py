"""The whole run, not three steps: the agent's step series read, checked and summarised.

``prof.step()`` times every step (``stepdoctor.series`` in the agent) and spools the series in
chunks beside the traces. This module is their one reader and validator, and the one owner of the
run-level numbers (``run_timeline``) and of the run-to-run comparison (``compare``) that
``stepdoctor analyze``, ``stepdoctor check`` and, later, the server all show:

* :func:`validate_chunk` refuses a bad chunk with one line (bounded size, known columns, lengths
  that match, finite header numbers, step numbers and ranges in order) and returns its columns;
* :func:`run_timeline` turns a run's chunk bytes into a :class:`RunTimeline`: step counts, the
  step time over all steps, the unprofiled steady-state median (what users pay for), capture
  windows, anomalies at full resolution, data wait, memory, and a downsampled curve for display;
* :func:`compare` decides whether a candidate regressed against a baseline, on the unprofiled
  steady-state step time when both runs have a series, else on profiled step times, and says which.

Everything here is pure (bytes and numbers in, structs out): :func:`series_files` is the only
function that touches the disk, so the server can feed the same function from its storage.
Anomalies use the agent's own rule (a step slower than ``k`` times the median of the previous
block of ``window`` unprofiled steps, after ``warmup`` steps), so the offline answer matches what
triggered the captures.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ..analyzers.memory_use import LEAK_MIN_MIB_PER_STEP, run_growth
from ..errors import TraceError

MAGIC = b"SDSERIES\x01"
SUFFIX = ".stepdoctor.series"
FORMAT = 1
#: A chunk's limits: what the agent writes is far below them (10,000 steps, ~20 KB).
MAX_CHUNK_BYTES = 16 * 2**20
MAX_HEADER_BYTES = 2**20
MAX_CHUNK_STEPS = 1_000_000
MAX_LIST_ITEMS = 100_000
MAX_STEP = 2**53
STEP_COLUMNS = ("wall_ns", "data_ns")
MEMORY_COLUMNS = ("mem_step", "mem_kind", "mem_a", "mem_b")
MEM_RSS, MEM_CUDA = 0, 1
#: Steps the curve for display is cut into at most; ``check`` and the statistics use every step.
DISPLAY_POINTS = 1000
_SENTINEL = np.iinfo(np.int64).max


class SeriesError(TraceError):
    """A step-series chunk (or a set of them) that cannot be used; ``str()`` is the one line."""


@dataclass(frozen=True)
class Chunk:
    """One validated chunk: its header and its columns (numpy int64)."""

    header: dict[str, Any]
    stream: str
    rank: int | None
    seq: int
    first_step: int
    wall_ns: np.ndarray
    data_ns: np.ndarray
    mem_step: np.ndarray
    mem_kind: np.ndarray
    mem_a: np.ndarray
    mem_b: np.ndarray

    @property
    def last_step(self) -> int:
        return self.first_step + len(self.wall_ns) - 1


# --- validation ---------------------------------------------------------------------------------


def _forbid_constant(name: str) -> float:
    raise SeriesError(f"series chunk header holds {name}, not a finite number")


def _int(header: dict[str, Any], key: str, *, low: int = 0, high: int = MAX_STEP) -> int:
    value = header.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise SeriesError(f"series chunk header: {key} must be an integer in [{low}, {high}], not {value!r}")
    return value


def _ranges(value: Any, what: str, first: int, last: int) -> list[tuple[int, int]]:
    """``[[a, b], ...]`` step ranges inside [first, last], in order, not overlapping."""
    if not isinstance(value, list) or len(value) > MAX_LIST_ITEMS:
        raise SeriesError(f"series chunk header: {what} must be a list of [first, last] step ranges")
    out: list[tuple[int, int]] = []
    for item in value:
        ok = isinstance(item, list) and len(item) == 2 and all(type(v) is int for v in item)
        if not ok or not first <= item[0] <= item[1] <= last or (out and item[0] <= out[-1][1]):
            raise SeriesError(
                f"series chunk header: {what} range {item!r} is not inside steps {first}-{last} "
                "in increasing order"
            )
        out.append((item[0], item[1]))
    return out


def _check_finite(value: Any, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise SeriesError(f"series chunk header: {where} is not a finite number")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(v, f"{where}[{i}]")


def validate_chunk(data: bytes, *, after_step: int | None = None) -> Chunk:
    """Parse and check one chunk; raise :class:`SeriesError` with one line when it is unusable.

    ``after_step``: the last step of the stream's previous chunk, when known; step numbers must
    keep increasing across chunks (a resent chunk is a duplicate, not a step back in time).
    """
    if len(data) > MAX_CHUNK_BYTES:
        raise SeriesError(f"series chunk is {len(data)} bytes, over the {MAX_CHUNK_BYTES} byte limit")
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise SeriesError("not a stepdoctor step-series chunk (bad magic bytes)")
    (head_len,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if head_len > MAX_HEADER_BYTES or start + head_len > len(data):
        raise SeriesError(f"series chunk header length {head_len} is over the limit or past the end")
    try:
        header = json.loads(data[start : start + head_len], parse_constant=_forbid_constant)
    except (ValueError, RecursionError) as exc:
        raise SeriesError(f"series chunk header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SeriesError("series chunk header must be a JSON object")
    _check_finite(header, "header")
    if header.get("kind") != "stepdoctor.series" or header.get("format") != FORMAT:
        raise SeriesError(
            f"series chunk format {header.get('format')!r} of kind {header.get('kind')!r} is not "
            f"stepdoctor.series format {FORMAT}"
        )
    stream = header.get("stream")
    if not isinstance(stream, str) or not 0 < len(stream) <= 64:
        raise SeriesError("series chunk header: stream must be a short string")
    rank = header.get("rank")
    if rank is not None:
        rank = _int(header, "rank", high=2**31)
    seq = _int(header, "seq", high=2**40)
    first = _int(header, "first_step")
    count = _int(header, "count", high=MAX_CHUNK_STEPS)
    if after_step is not None and first <= after_step:
        raise SeriesError(f"series chunk starts at step {first}, not after step {after_step}: steps go back")
    columns = _columns(header, data[start + head_len :], count)
    wall, data_ns = columns["wall_ns"], columns["data_ns"]
    if len(wall) and (wall.min() < 0 or data_ns.min() < -1):
        raise SeriesError("series chunk: step times must be >= 0 and data waits >= 0 (or -1: unknown)")
    last = first + count - 1
    mem_step = columns["mem_step"]
    if len(mem_step) and (
        mem_step[0] < first or mem_step[-1] > last or (len(mem_step) > 1 and np.any(np.diff(mem_step) <= 0))
    ):
        raise SeriesError(f"series chunk: memory samples must be at increasing steps within {first}-{last}")
    if len(mem_step) and not np.isin(columns["mem_kind"], (MEM_RSS, MEM_CUDA)).all():
        raise SeriesError("series chunk: mem_kind must be 0 (process RSS) or 1 (CUDA)")
    _ranges(header.get("profiled", []), "profiled", first, last)
    for name in ("windows", "anomalies"):
        items = header.get(name, [])
        if (
            not isinstance(items, list)
            or len(items) > MAX_LIST_ITEMS
            or not all(isinstance(i, dict) for i in items)
        ):
            raise SeriesError(f"series chunk header: {name} must be a list of objects")
    for window in header.get("windows", []):
        a, b = window.get("first_step"), window.get("last_step")
        if a is not None and (type(a) is not int or type(b) is not int or not 0 <= a <= b <= last):
            raise SeriesError(f"series chunk header: window {window!r} is not a step range up to {last}")
    for anomaly in header.get("anomalies", []):
        step = anomaly.get("step")
        if type(step) is not int or not first <= step <= last:
            raise SeriesError(f"series chunk header: anomaly at step {step!r} is outside {first}-{last}")
    return Chunk(
        header,
        stream,
        rank,
        seq,
        first,
        wall,
        data_ns,
        mem_step,
        columns["mem_kind"],
        columns["mem_a"],
        columns["mem_b"],
    )


def _columns(header: dict[str, Any], body: bytes, count: int) -> dict[str, np.ndarray]:
    declared = header.get("columns")
    names = STEP_COLUMNS + MEMORY_COLUMNS
    if not isinstance(declared, list) or [
        c[0] if isinstance(c, list) and len(c) == 3 else None for c in declared
    ] != list(names):
        raise SeriesError(
            f"series chunk columns must be [name, dtype, length] for {', '.join(names)} in that order"
        )
    lengths = []
    for name, dtype, length in declared:
        if dtype != "<i8" or type(length) is not int or not 0 <= length <= MAX_CHUNK_STEPS:
            raise SeriesError(f"series chunk column {name}: dtype {dtype!r}, length {length!r} not allowed")
        lengths.append(length)
    if lengths[0] != count or lengths[1] != count:
        raise SeriesError(f"series chunk: wall_ns and data_ns must hold count={count} values")
    if len(set(lengths[2:])) != 1:
        raise SeriesError("series chunk: memory columns must have one length")
    size = 8 * sum(lengths)
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(body, size + 1)
    except zlib.error as exc:
        raise SeriesError(f"series chunk columns do not decompress: {exc}") from None
    if len(raw) != size or inflater.unconsumed_tail or not inflater.eof or inflater.unused_data:
        raise SeriesError(f"series chunk columns are not the {size} bytes the header declares")
    values = np.frombuffer(raw, dtype="<i8").astype(np.int64)
    out, offset = {}, 0
    for name, length in zip(names, lengths, strict=True):
        out[name] = values[offset : offset + length]
        offset += length
    return out


# --- the run timeline ---------------------------------------------------------------------------


class StepTime(msgspec.Struct, frozen=True):
    median: float
    p90: float
    mean: float


class Window(msgspec.Struct, frozen=True):
    first_step: int
    last_step: int
    reason: str


class Anomaly(msgspec.Struct, frozen=True):
    first_step: int
    last_step: int
    max_ms: float
    median_ms: float  # the block median the rule compared against
    captured: bool  # the agent captured a window because of it


class Memory(msgspec.Struct, frozen=True):
    kind: str  # "cuda" (allocated/reserved) or "rss"
    samples: int
    last_bytes: int
    peak_bytes: int
    reserved_peak_bytes: int | None
    # Bytes per step over the run, from the lowest sample of each quarter (``memory_use.run_growth``),
    # and whether that growth is steady and at least the leak threshold (``memory.leak``'s).
    growth_per_step: float | None = None
    leak: bool = False


class Display(msgspec.Struct, frozen=True):
    """The curve for a plot: ``bucket`` steps per point; step time median and max per bucket."""

    bucket: int
    step: list[int]
    median_ms: list[float]
    max_ms: list[float]
    data_ms: list[float] | None
    profiled: list[bool]
    # Memory at each bucket's highest sample (``Memory.kind``'s: CUDA allocated, else process
    # RSS), carried forward across buckets without a sample; None without memory samples.
    memory_mib: list[float] | None = None


class RunTimeline(msgspec.Struct, frozen=True):
    """A run's step series summarised (rank ``rank``'s series; restarts counted together).

    ``unprofiled_median_ms`` is the steady state: steps outside capture windows, after the first
    ``warmup_steps`` of each process. ``finished``: the agent wrote its exit chunk.
    """

    steps: int
    rank: int | None
    step_time_ms: StepTime
    unprofiled_median_ms: float | None
    unprofiled_p90_ms: float | None
    unprofiled_steps: int
    profiled_median_ms: float | None
    warmup_steps: int
    throughput_steps_per_s: float | None
    data_wait_ms: float | None  # median per steady step; None when the loader was not known
    data_wait_share: float | None
    memory: Memory | None
    windows: list[Window]
    anomalies: list[Anomaly]  # the slowest MAX_ANOMALIES ranges, in step order
    anomaly_steps: int  # every anomalous step, listed or not
    missing_steps: int
    finished: bool
    last_heartbeat: float | None
    display: Display

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


@dataclass
class _Stream:
    rank: int | None
    chunks: list[Chunk]


def run_timeline(chunks: Iterable[bytes], *, points: int = DISPLAY_POINTS) -> RunTimeline:
    """The run-level numbers from a run's chunk bytes (any order; duplicates ignored).

    Raises :class:`SeriesError` when a chunk is bad or none holds a step.
    """
    streams: dict[str, _Stream] = {}
    for data in chunks:
        chunk = validate_chunk(data)
        stream = streams.setdefault(chunk.stream, _Stream(chunk.rank, []))
        stream.chunks.append(chunk)
    ranked = sorted(streams.values(), key=lambda s: (s.rank is None, s.rank or 0))
    if not ranked:
        raise SeriesError("no step-series chunks")
    rank = ranked[0].rank
    mine = [s for s in ranked if s.rank == rank]
    mine.sort(key=lambda s: min(float(c.header.get("t_end") or 0) for c in s.chunks))
    parts = [_assemble(s.chunks) for s in mine]
    if not sum(len(p.wall) for p in parts):
        raise SeriesError("the step series holds no steps")
    return _summarise(parts, rank, points)


@dataclass
class _Part:
    """One process's series, contiguous by step (missing chunks left as gaps)."""

    steps: np.ndarray
    wall: np.ndarray
    data: np.ndarray
    profiled: np.ndarray
    mem_kind: np.ndarray
    mem_a: np.ndarray
    mem_b: np.ndarray
    mem_step: np.ndarray
    windows: list[Window]
    agent_anomalies: dict[int, bool]
    k: float
    window: int
    warmup: int
    min_ms: float
    post_window: int
    missing: int
    finished: bool
    t_end: float | None


def _assemble(chunks: list[Chunk]) -> _Part:
    chunks = sorted(chunks, key=lambda c: c.seq)
    unique: list[Chunk] = []
    for c in chunks:
        if unique and c.seq == unique[-1].seq:
            continue  # the same chunk twice (resent)
        if unique and c.first_step <= unique[-1].last_step:
            raise SeriesError(
                f"series stream {c.stream}: chunk {c.seq} starts at step {c.first_step}, "
                f"not after step {unique[-1].last_step}: steps go back"
            )
        unique.append(c)
    steps = np.concatenate([np.arange(c.first_step, c.first_step + len(c.wall_ns)) for c in unique])
    profiled = np.zeros(len(steps), dtype=bool)
    base = 0
    for c in unique:
        for a, b in c.header.get("profiled", []):
            profiled[base + a - c.first_step : base + b - c.first_step + 1] = True
        base += len(c.wall_ns)
    windows = [
        Window(int(w["first_step"]), int(w["last_step"]), str(w.get("reason") or "schedule"))
        for c in unique
        for w in c.header.get("windows", [])
        if w.get("first_step") is not None
    ]
    anomalies = {
        int(a["step"]): bool(a.get("captured")) for c in unique for a in c.header.get("anomalies", [])
    }
    settings = unique[-1].header.get("anomaly") or {}
    expected = unique[-1].last_step + 1  # the agent numbers a process's steps from 0
    return _Part(
        steps=steps,
        wall=np.concatenate([c.wall_ns for c in unique]),
        data=np.concatenate([c.data_ns for c in unique]),
        profiled=profiled,
        mem_kind=np.concatenate([c.mem_kind for c in unique]),
        mem_a=np.concatenate([c.mem_a for c in unique]),
        mem_b=np.concatenate([c.mem_b for c in unique]),
        mem_step=np.concatenate([c.mem_step for c in unique]),
        windows=windows,
        agent_anomalies=anomalies,
        k=_number(settings.get("k"), 1.5, low=1.0),
        window=int(_number(settings.get("window"), 50, low=2)),
        warmup=int(_number(settings.get("warmup"), 50, low=0)),
        min_ms=float(_number(settings.get("min_ms"), 0.0, low=0.0)),
        post_window=int(_number(settings.get("post_window"), 0, low=0)),
        missing=max(0, expected - len(steps)),
        finished=bool(unique[-1].header.get("final")),
        t_end=_number(unique[-1].header.get("t_end"), None, low=0.0),
    )


def _number(value: Any, default: Any, *, low: float) -> Any:
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= low:
        return value
    return default


def _steady_mask(part: _Part) -> np.ndarray:
    """Unprofiled steps after the warm-up (at most half the process's steps)."""
    warm = min(part.warmup, len(part.steps) // 2)
    mask = ~part.profiled
    mask[:warm] = False
    return mask


def block_references(
    steps: np.ndarray, wall: np.ndarray, profiled: np.ndarray, *, window: int, warmup: int
) -> np.ndarray:
    """Per step, the median (ns) the anomaly rule compares it against; NaN where there is none.

    Blocks are ``window`` steps long and start at step ``warmup`` (absolute step numbers); each
    step is compared with the upper median of the unprofiled steps of the previous block, and a
    block with fewer than half its steps unprofiled keeps the reference before it. This is the
    agent's rule (``stepdoctor.series``), run over every step at once.
    """
    refs = np.full(len(steps), np.nan)
    if not len(steps):
        return refs
    first, last = int(steps[0]), int(steps[-1])
    span = last - first + 1
    if span > 2 * len(steps) + 1_000_000:  # wildly gapped: no dense view
        return refs
    dense = np.full(span, _SENTINEL, dtype=np.int64)
    dense[steps - first] = np.where(profiled, _SENTINEL, wall)
    idx0 = warmup + max(0, -(-(first - warmup) // window)) * window - first
    nb = (span - idx0) // window if idx0 < span else 0
    if nb < 1:
        return refs
    blocks = dense[idx0 : idx0 + nb * window].reshape(nb, window)
    counts = (blocks != _SENTINEL).sum(axis=1)
    ordered = np.sort(blocks, axis=1)
    medians = ordered[np.arange(nb), np.minimum(counts // 2, window - 1)].astype(np.float64)
    valid = 2 * counts >= window
    carry = np.where(valid, np.arange(nb), -1)
    np.maximum.accumulate(carry, out=carry)
    per_block = np.where(carry >= 0, medians[np.maximum(carry, 0)], np.nan)
    rel = (steps - first) - idx0
    has = rel >= window
    refs[has] = per_block[np.minimum(rel[has] // window - 1, nb - 1)]
    return refs


def detect_anomalies(
    steps: np.ndarray,
    wall: np.ndarray,
    profiled: np.ndarray,
    *,
    k: float,
    window: int,
    warmup: int,
    min_ms: float = 0.0,
    post_window: int = 0,
    refs: np.ndarray | None = None,
) -> np.ndarray:
    """Mask of unprofiled steps slower than ``k`` x their reference (:func:`block_references`) and
    at least ``min_ms`` above it (the agent's ``anomaly_threshold``), leaving out the first
    ``post_window`` steps after profiled ones (the agent's ``POST_WINDOW_STEPS``)."""
    if refs is None:
        refs = block_references(steps, wall, profiled, window=window, warmup=warmup)
    ok = ~np.isnan(refs) & ~profiled
    for shift in range(1, min(post_window, len(steps)) + 1):
        after = np.zeros(len(steps), dtype=bool)
        after[shift:] = profiled[:-shift] & (steps[shift:] - steps[:-shift] == shift)
        ok &= ~after
    ref = refs[ok].astype(np.int64)
    thresholds = np.zeros(len(steps), dtype=np.int64)
    thresholds[ok] = np.maximum((k * refs[ok]).astype(np.int64), ref + int(min_ms * 1e6))
    return ok & (wall > thresholds)


#: Anomaly ranges listed at most (the slowest); ``anomaly_steps`` counts them all.
MAX_ANOMALIES = 100


def _anomaly_ranges(part: _Part) -> tuple[list[Anomaly], int]:
    """(the slowest ``MAX_ANOMALIES`` ranges of consecutive anomalous steps in step order, all
    anomalous steps); the agent's own detections count even where the series misses a step."""
    refs = block_references(part.steps, part.wall, part.profiled, window=part.window, warmup=part.warmup)
    hits = detect_anomalies(
        part.steps,
        part.wall,
        part.profiled,
        k=part.k,
        window=part.window,
        warmup=part.warmup,
        min_ms=part.min_ms,
        post_window=part.post_window,
        refs=refs,
    )
    agent = np.isin(
        part.steps, np.fromiter(part.agent_anomalies, dtype=np.int64, count=len(part.agent_anomalies))
    )
    hits |= agent
    where = np.flatnonzero(hits)
    if not len(where):
        return [], 0
    breaks = np.flatnonzero(np.diff(part.steps[where]) != 1) + 1
    ranges = [(int(idx[0]), int(idx[-1])) for idx in np.split(where, breaks)]
    peaks = [int(part.wall[a : b + 1].max()) for a, b in ranges]
    keep = sorted(sorted(range(len(ranges)), key=lambda i: -peaks[i])[:MAX_ANOMALIES])
    out = []
    for i in keep:
        a, b = ranges[i]
        first, last = int(part.steps[a]), int(part.steps[b])
        ref = refs[a]
        out.append(
            Anomaly(
                first_step=first,
                last_step=last,
                max_ms=round(peaks[i] / 1e6, 3),
                median_ms=round(float(ref) / 1e6, 3) if not np.isnan(ref) else 0.0,
                captured=any(part.agent_anomalies.get(s, False) for s in range(first, last + 1)),
            )
        )
    return out, len(where)


def _ms(values: np.ndarray, q: float) -> float:
    return round(float(np.percentile(values, q)) / 1e6, 3)


def _median_p90(values: np.ndarray) -> tuple[float, float] | tuple[None, None]:
    """(median, p90) in ms with one partition of ``values`` (ns)."""
    if not len(values):
        return None, None
    median, p90 = np.percentile(values, [50, 90])
    return round(float(median) / 1e6, 3), round(float(p90) / 1e6, 3)


def _summarise(parts: list[_Part], rank: int | None, points: int) -> RunTimeline:
    wall = np.concatenate([p.wall for p in parts])
    steady = np.concatenate([p.wall[_steady_mask(p)] for p in parts])
    profiled_walls = np.concatenate([p.wall[p.profiled] for p in parts])
    data = np.concatenate([p.data[_steady_mask(p)] for p in parts])
    known = data[data >= 0]
    median_steady, p90_steady = _median_p90(steady)
    median_all, p90_all = _median_p90(wall)
    found = [_anomaly_ranges(p) for p in parts]
    data_wait = _ms(known, 50) if len(known) else None
    data_share = (
        round(float(known.sum()) / float(steady[data >= 0].sum()), 4)
        if len(known) and steady[data >= 0].sum() > 0
        else None
    )
    return RunTimeline(
        steps=len(wall),
        rank=rank,
        step_time_ms=StepTime(
            median=median_all or 0.0, p90=p90_all or 0.0, mean=round(float(wall.mean()) / 1e6, 3)
        ),
        unprofiled_median_ms=median_steady,
        unprofiled_p90_ms=p90_steady,
        unprofiled_steps=len(steady),
        profiled_median_ms=_ms(profiled_walls, 50) if len(profiled_walls) else None,
        warmup_steps=sum(min(p.warmup, len(p.steps) // 2) for p in parts),
        throughput_steps_per_s=round(1000.0 / median_steady, 3) if median_steady else None,
        data_wait_ms=data_wait,
        data_wait_share=data_share,
        memory=_memory(parts),
        windows=[w for p in parts for w in p.windows],
        anomalies=[anomaly for listed, _ in found for anomaly in listed],
        anomaly_steps=sum(n for _, n in found),
        missing_steps=sum(p.missing for p in parts),
        finished=parts[-1].finished,
        last_heartbeat=parts[-1].t_end,
        display=_display(parts, points),
    )


def _memory(parts: list[_Part]) -> Memory | None:
    kind = np.concatenate([p.mem_kind for p in parts])
    if not len(kind):
        return None
    a = np.concatenate([p.mem_a for p in parts])
    b = np.concatenate([p.mem_b for p in parts])
    which = MEM_CUDA if (kind == MEM_CUDA).any() else MEM_RSS
    sel = kind == which
    reserved = b[sel]
    # Each process numbers its steps from 0: growth is read per process, the fastest steady one kept.
    grown = [run_growth(p.mem_step[p.mem_kind == which], p.mem_a[p.mem_kind == which]) for p in parts]
    growth, steady = max(grown, key=lambda g: (g[1], g[0]))
    return Memory(
        kind="cuda" if which == MEM_CUDA else "rss",
        samples=int(sel.sum()),
        last_bytes=int(a[sel][-1]),
        peak_bytes=int(a[sel].max()),
        reserved_peak_bytes=int(reserved.max()) if which == MEM_CUDA and len(reserved) else None,
        growth_per_step=round(growth, 1),
        leak=steady and growth >= LEAK_MIN_MIB_PER_STEP * 2**20,
    )


def _display(parts: list[_Part], points: int) -> Display:
    """Median and max step time per bucket of steps: a 10-million-step run in ``points`` points."""
    steps = np.concatenate([p.steps for p in parts])
    wall = np.concatenate([p.wall for p in parts]).astype(np.float64) / 1e6
    data = np.concatenate([p.data for p in parts]).astype(np.float64) / 1e6
    prof = np.concatenate([p.profiled for p in parts])
    n = len(wall)
    bucket = max(1, -(-n // max(1, points)))
    m = n // bucket * bucket
    shape = (-1, bucket)
    full = wall[:m].reshape(shape)
    med, mx = list(np.median(full, axis=1)), list(full.max(axis=1))
    st = list(steps[:m:bucket])
    dat = list(np.median(data[:m].reshape(shape), axis=1)) if (data >= 0).any() else None
    pro = [bool(v) for v in np.asarray(prof[:m].reshape(shape).any(axis=1))]
    if m < n:
        med.append(float(np.median(wall[m:])))
        mx.append(float(wall[m:].max()))
        st.append(steps[m])
        pro.append(bool(prof[m:].any()))
        if dat is not None:
            dat.append(float(np.median(data[m:])))
    return Display(
        bucket=bucket,
        step=[int(s) for s in st],
        median_ms=[round(float(v), 3) for v in med],
        max_ms=[round(float(v), 3) for v in mx],
        data_ms=None if dat is None else [round(max(0.0, float(v)), 3) for v in dat],
        profiled=[bool(v) for v in pro],
        memory_mib=_display_memory(parts, n, bucket),
    )


def _display_memory(parts: list[_Part], n: int, bucket: int) -> list[float] | None:
    """Per display bucket, the highest memory sample in it (the last one before, where it has none)."""
    kinds = [p.mem_kind for p in parts]
    if not any(len(k) for k in kinds):
        return None
    which = MEM_CUDA if any((k == MEM_CUDA).any() for k in kinds) else MEM_RSS
    dense = np.full(n, np.nan)
    offset = 0
    for p in parts:
        sel = p.mem_kind == which
        at = np.searchsorted(p.steps, p.mem_step[sel]) + offset
        ok = at < offset + len(p.steps)
        dense[at[ok]] = p.mem_a[sel][ok]
        offset += len(p.steps)
    seen = np.where(np.isnan(dense), 0, np.arange(n))
    np.maximum.accumulate(seen, out=seen)
    filled = dense[seen]  # carried forward; NaN before the first sample
    starts = np.arange(0, n, bucket)
    with np.errstate(invalid="ignore"):
        peaks = np.fmax.reduceat(filled, starts)
    return [round(float(v) / 2**20, 1) if np.isfinite(v) else 0.0 for v in peaks]


def series_files(folder: Path) -> list[Path]:
    """The step-series chunks in a run folder (the spool's, or a copy of it)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(SUFFIX))


def read_run_timeline(folder: Path, *, points: int = DISPLAY_POINTS) -> RunTimeline | None:
    """:func:`run_timeline` of the chunks in ``folder``, or None when it holds none."""
    files = series_files(folder)
    if not files:
        return None
    return run_timeline((f.read_bytes() for f in files), points=points)


# --- comparing two runs -------------------------------------------------------------------------


class Side(msgspec.Struct, frozen=True):
    """One run as ``compare`` sees it: the steady unprofiled median (from the series) and/or the
    profiled step time (from its traces), and the verdict of its traces when analysed."""

    source: str
    unprofiled_median_ms: float | None = None
    profiled_ms: float | None = None
    verdict: str | None = None
    steps: int | None = None


class Comparison(msgspec.Struct, frozen=True):
    basis: str  # "unprofiled" (steady-state, every step) or "profiled" (capture windows only)
    candidate_ms: float
    baseline_ms: float
    change: float  # candidate / baseline - 1 (positive: slower)
    max_regression: float
    regression: bool
    candidate_verdict: str | None
    baseline_verdict: str | None
    verdict_changed: bool
    candidate: Side
    baseline: Side

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


class NothingComparable(SeriesError):
    """Neither basis is available on both sides."""


def compare(candidate: Side, baseline: Side, *, max_regression: float = 0.05) -> Comparison:
    """Did ``candidate`` regress against ``baseline``? One function for ``check`` and the server.

    The unprofiled steady-state median is the basis when both runs have a step series (it is what
    users pay for; profiled steps are slowed by the profiler); otherwise the profiled step time
    when both have traces. A step time above ``baseline * (1 + max_regression)`` is a regression.
    """
    basis = None
    if candidate.unprofiled_median_ms and baseline.unprofiled_median_ms:
        basis, cand, base = "unprofiled", candidate.unprofiled_median_ms, baseline.unprofiled_median_ms
    elif candidate.profiled_ms and baseline.profiled_ms:
        basis, cand, base = "profiled", candidate.profiled_ms, baseline.profiled_ms
    if basis is None:
        raise NothingComparable(
            f"nothing comparable: {candidate.source} has {_has(candidate)}, {baseline.source} has {_has(baseline)}"
        )
    change = cand / base - 1.0
    changed = (
        candidate.verdict is not None
        and baseline.verdict is not None
        and candidate.verdict != baseline.verdict
    )
    return Comparison(
        basis=basis,
        candidate_ms=round(cand, 3),
        baseline_ms=round(base, 3),
        change=round(change, 4),
        max_regression=max_regression,
        regression=change > max_regression,
        candidate_verdict=candidate.verdict,
        baseline_verdict=baseline.verdict,
        verdict_changed=changed,
        candidate=candidate,
        baseline=baseline,
    )


def _has(side: Side) -> str:
    if side.unprofiled_median_ms:
        return "only a step series (no traces)"
    if side.profiled_ms:
        return "only traces (no step series)"
    return "neither a step series nor traces"


def render_text(t: dict[str, Any]) -> str:
    """The timeline in a few terminal lines (``stepdoctor analyze``'s text output)."""

    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f} ms"

    st = t["step_time_ms"]
    lines = [
        f"Run timeline: {t['steps']} steps timed, step time median {ms(st['median'])} (p90 {ms(st['p90'])})",
        f"  steady state, unprofiled: {ms(t['unprofiled_median_ms'])} per step"
        + (f" ({t['throughput_steps_per_s']:.1f} steps/s)" if t["throughput_steps_per_s"] else "")
        + (f"; profiled steps {ms(t['profiled_median_ms'])}" if t["profiled_median_ms"] is not None else ""),
    ]
    if t["data_wait_ms"] is not None:
        share = t["data_wait_share"]
        lines.append(
            f"  waiting for data: {ms(t['data_wait_ms'])} per step"
            + (f" ({100 * share:.0f}% of step time)" if share is not None else "")
        )
    if t["memory"]:
        m = t["memory"]
        lines.append(
            f"  memory ({m['kind']}): peak {m['peak_bytes'] / 2**20:.0f} MiB, last {m['last_bytes'] / 2**20:.0f} MiB"
            + (
                f"; grows {m['growth_per_step'] / 2**20:.1f} MiB every step over the run (a leak: a tensor kept "
                "across steps, e.g. losses.append(loss) instead of loss.item())"
                if m.get("leak")
                else ""
            )
        )
    if t["windows"]:
        wins = ", ".join(f"{w['first_step']}-{w['last_step']} ({w['reason']})" for w in t["windows"][:10])
        lines.append(f"  capture windows: {wins}" + (" ..." if len(t["windows"]) > 10 else ""))
    if t["anomalies"]:
        worst = max(t["anomalies"], key=lambda a: a["max_ms"])
        lines.append(
            f"  anomalies: {t['anomaly_steps']} slow step(s) in {len(t['anomalies'])} range(s) listed; slowest "
            f"steps {worst['first_step']}-{worst['last_step']} at {worst['max_ms']:.1f} ms "
            f"(median before: {worst['median_ms']:.2f} ms)"
        )
    if t["missing_steps"]:
        lines.append(f"  {t['missing_steps']} step(s) missing from the series (chunks not written)")
    if not t["finished"]:
        lines.append("  the process has not finished (or stopped without its exit chunk)")
    return "\n".join(lines) + "\n"
