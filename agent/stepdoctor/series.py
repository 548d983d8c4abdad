"""Every step timed: the step series ``prof.step()`` records outside and inside capture windows.

Capture windows see 3 steps that the profiler itself slows down; the series sees all of them, at
the cost the training loop pays. For every step it keeps the wall time and the time the loop
waited in the DataLoader's ``__next__`` (when the loader is known), and memory at step ends:
sampled at most once per second outside windows (a reading costs far more than the timing:
``torch.cuda.memory_allocated`` builds a stats dict, RSS reads ``/proc``) and at every step inside
windows. The hot path (``Profile.step``) only appends two integers to ``array('q')`` columns and
compares three numbers; everything else happens once per block of steps, second or chunk.

Chunks (every ``chunk_steps`` steps or ``chunk_seconds`` seconds, and at exit) go to a writer
thread that puts them beside the traces in the spool, atomically, so the loop never waits on the
disk. A chunk is a small JSON header plus zlib-compressed little-endian int64 columns::

    b"SDSERIES" 0x01 | uint32 header length | header JSON | zlib(columns, in header order)

``stepdoctor_analysis.run.timeline.validate_chunk`` is the reader and the validator (the server
reuses it); the agent does not import it (standard library + torch only), and a test round-trips
what this module writes through it.

Anomaly capture: a step slower than ``k`` times the median of the previous block of ``window``
unprofiled steps (after ``warmup`` steps) asks the profiler for the next window, at most once per
``interval`` seconds. The engine's offline detector uses the same block rule, so the anomalies
``stepdoctor analyze`` reports are the ones the agent saw.
"""

from __future__ import annotations

import array
import contextlib
import copyreg
import json
import os
import queue
import struct
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepdoctor.guard import guarded, say

MAGIC = b"SDSERIES\x01"
SUFFIX = ".stepdoctor.series"
FORMAT = 1
#: Column order in a chunk; per-step columns have ``count`` values, memory columns one per sample.
STEP_COLUMNS = ("wall_ns", "data_ns")
MEMORY_COLUMNS = ("mem_step", "mem_kind", "mem_a", "mem_b")
MEM_RSS, MEM_CUDA = 0, 1
NEVER = 2**62
#: Steps after a window that never count as slow: the delivery thread compresses the window's trace
#: meanwhile, and on a busy machine that shows in the next steps (measured: up to 2x on a 20 ms step).
POST_WINDOW_STEPS = 5
_perf_ns = time.perf_counter_ns
_LITTLE = sys.byteorder == "little"


@dataclass(frozen=True)
class SeriesSettings:
    """How the series is kept and when a slow step triggers a capture.

    ``anomaly_capture=False`` keeps recording (and reporting) slow steps but never captures on them.
    ``anomaly_interval`` seconds must pass between two anomaly captures (default 10 minutes).
    """

    enabled: bool = True
    chunk_steps: int = 10_000
    chunk_seconds: float = 10.0
    memory_every_s: float = 1.0
    anomaly_capture: bool = True
    anomaly_k: float = 1.5
    anomaly_window: int = 50
    anomaly_warmup: int = 50
    anomaly_interval: float = 600.0
    anomaly_min_ms: float = 1.0

    def __post_init__(self) -> None:
        if self.chunk_steps < 1 or not 0 < self.chunk_seconds < float("inf"):
            raise ValueError("series chunks need chunk_steps >= 1 and a finite chunk_seconds > 0")
        if not self.anomaly_k > 1.0 or self.anomaly_window < 2 or self.anomaly_warmup < 0:
            raise ValueError("anomaly_k must be above 1, anomaly_window at least 2, anomaly_warmup >= 0")
        if not self.anomaly_interval >= 0 or not self.anomaly_min_ms >= 0:
            raise ValueError("anomaly_interval and anomaly_min_ms must be >= 0")


def settings_from_env(**given: Any) -> SeriesSettings:
    """Arguments win; ``STEPDOCTOR_SERIES=0`` turns the series off, ``STEPDOCTOR_ANOMALY_CAPTURE=0``
    the anomaly capture, ``STEPDOCTOR_ANOMALY_K`` / ``STEPDOCTOR_ANOMALY_INTERVAL`` tune it."""
    env = os.environ
    values = {k: v for k, v in given.items() if v is not None}
    if "enabled" not in values and env.get("STEPDOCTOR_SERIES", "").strip() in ("0", "false", "off", "no"):
        values["enabled"] = False
    capture = env.get("STEPDOCTOR_ANOMALY_CAPTURE", "").strip().lower()
    if "anomaly_capture" not in values and capture in ("0", "false", "off", "no"):
        values["anomaly_capture"] = False
    if "anomaly_k" not in values and env.get("STEPDOCTOR_ANOMALY_K", "").strip():
        values["anomaly_k"] = float(env["STEPDOCTOR_ANOMALY_K"])
    if "anomaly_interval" not in values and env.get("STEPDOCTOR_ANOMALY_INTERVAL", "").strip():
        values["anomaly_interval"] = float(env["STEPDOCTOR_ANOMALY_INTERVAL"])
    return SeriesSettings(**values)


def anomaly_threshold(median_ns: int, k: float, min_ms: float) -> int:
    """Slower than this (ns) is an anomaly: ``k`` x the median, and at least ``min_ms`` above it
    (a 0.2 ms step that took 0.4 ms is scheduler noise, not worth a capture)."""
    return max(int(k * median_ns), median_ns + int(min_ms * 1e6))


def block_median(values: list[int]) -> int:
    """The median the anomaly rule compares against (upper median on even counts, like the engine)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class SeriesRecorder:
    """The per-step columns of one process, its anomaly detector and its chunk writer.

    ``Profile.step`` touches ``last``, ``wall``, ``data``, ``data_acc``, ``data_reset``,
    ``threshold``, ``due`` and ``next_step`` directly (a method call would cost more than the
    whole recording); :meth:`event` runs when one of the three limits is crossed. Slots, because
    attribute access is most of what the hot path does.
    """

    __slots__ = (
        "_all_profiled",
        "_anomalies",
        "_block_end",
        "_capture",
        "_flush_due",
        "_header",
        "_last_capture",
        "_mem",
        "_mem_due",
        "_pid",
        "_profiled",
        "_quiet_until",
        "_ref_ns",
        "_run_dir",
        "_seq",
        "_stream",
        "_tail",
        "_tail_first",
        "_windows",
        "_writer",
        "anomaly_count",
        "data",
        "data_acc",
        "data_reset",
        "due",
        "first",
        "last",
        "next_step",
        "settings",
        "steps",
        "threshold",
        "wall",
    )

    def __init__(
        self,
        settings: SeriesSettings,
        run_dir: Callable[[], Path | None],
        header: dict[str, Any],
        capture: Callable[[int, int, int], bool],
        on_written: Callable[[], None] | None = None,
    ) -> None:
        """``on_written`` runs on the writer thread after chunks reached the disk (the delivery
        worker's ``notify``: chunks are the run's heartbeat, shipped as they come)."""
        self.settings = settings
        self._run_dir = run_dir
        self._header = dict(header)
        self._capture = capture
        self._stream = uuid.uuid4().hex[:12]
        self._seq = 0
        self._pid = os.getpid()
        # hot columns and limits
        self.last = _perf_ns()
        self.wall = array.array("q")
        self.data = array.array("q")
        self.data_acc = -1
        self.data_reset = -1
        self.first = 0  # step number of wall[0]
        self.threshold = NEVER
        self.due = 0
        self.next_step = 0
        # slow-path state
        self._mem = {name: array.array("q") for name in MEMORY_COLUMNS}
        self._mem_due = 0
        self._flush_due = self.last + int(settings.chunk_seconds * 1e9)
        self._block_end = settings.anomaly_warmup + settings.anomaly_window - 1  # last step of 1st block
        self._ref_ns = 0
        self._tail = array.array("q")  # the last ``anomaly_window`` walls of earlier chunks
        self._tail_first = 0
        self._profiled: list[list[int]] = []  # [first, last] step ranges the profiler was running
        self._all_profiled: list[list[int]] = []  # every range so far: blocks may reach back a chunk
        self._windows: list[dict[str, Any]] = []
        self._anomalies: list[dict[str, Any]] = []
        self._last_capture = -float("inf")
        self._quiet_until = -1  # steps up to here are right after a window: not checked
        self.anomaly_count = 0
        self.steps = 0  # steps handed to chunks so far
        self._writer = _ChunkWriter(run_dir, on_written)
        self._limits()

    # --- training thread ------------------------------------------------------------------------

    def loader_known(self) -> None:
        """Data wait is measured from now on (a loader was passed or watched)."""
        self.data_reset = 0
        if self.data_acc < 0:
            self.data_acc = 0

    @guarded()
    def event(self, step: int, now: int, wall: int) -> None:
        """A limit was crossed at the end of unprofiled ``step``: a slow step, a due memory sample or
        chunk, or the end of a median block."""
        if wall > self.threshold and step > self.settings.anomaly_warmup and step > self._quiet_until:
            self._slow(step, now, wall)
        if now >= self._mem_due:
            self._sample_memory(step, now)
        self._after_step(step, now)

    @guarded()
    def profiled_step(self, step: int) -> None:
        """Record a step the profiler ran over (warm-up or recorded): wall, data, memory every step."""
        now = _perf_ns()
        self.wall.append(now - self.last)
        self.data.append(self.data_acc)
        self.data_acc = self.data_reset
        ranges = self._profiled
        if ranges and ranges[-1][1] == step - 1:
            ranges[-1][1] = step
            self._all_profiled[-1][1] = step
        else:
            ranges.append([step, step])
            self._all_profiled.append([step, step])
        self._quiet_until = step + POST_WINDOW_STEPS
        self._sample_memory(step, now)
        self._after_step(step, now)

    def restart_clock(self) -> None:
        """The agent's own work (a window's start or export) is no step's time."""
        self.last = _perf_ns()

    def window_saved(self, window: dict[str, Any]) -> None:
        self._windows.append(dict(window))

    @guarded()
    def close(self, timeout: float, *, clean: bool = True) -> None:
        """Hand the last chunk to the writer and wait (bounded) until everything is on disk.

        ``clean=False``: the loop ended with an exception (the final chunk says so, and the server
        shows the run as stopped, not finished)."""
        if os.getpid() != self._pid:
            return
        self._flush(final=True, clean=clean)
        forget_loaders(self)
        left = self._writer.close(timeout)
        if left:
            say(
                f"stepdoctor: {left} step-series chunk(s) could not be written to {self._run_dir()} "
                f"within {timeout:g} s; those steps are missing from the run's timeline"
            )

    # --- slow path ------------------------------------------------------------------------------

    def _after_step(self, step: int, now: int) -> None:
        if step >= self._block_end:
            self._new_reference(step)
        if now >= self._flush_due or len(self.wall) >= self.settings.chunk_steps:
            self._flush(final=False)
        self._limits()

    def _limits(self) -> None:
        self.due = min(self._mem_due, self._flush_due)
        self.next_step = min(self._block_end, self.first + self.settings.chunk_steps - 1)

    def _slow(self, step: int, now: int, wall: int) -> None:
        """Count every slow step (the engine finds them all again in the series); keep the ones
        that captured a window, so the timeline can say which capture each slowdown got."""
        self.anomaly_count += 1
        since = (now - self._last_capture) / 1e9
        if not self.settings.anomaly_capture or since < self.settings.anomaly_interval:
            return
        if self._capture(step, wall, self._ref_ns):
            self._last_capture = now
            self._anomalies.append(
                {"step": step, "step_ms": wall / 1e6, "median_ms": self._ref_ns / 1e6, "captured": True}
            )

    def _new_reference(self, step: int) -> None:
        """The block of ``window`` steps ending at ``step`` becomes the reference of the next block."""
        size = self.settings.anomaly_window
        first = step - size + 1
        walls = self._block(first, step)
        if self._all_profiled:
            walls = [
                w
                for s, w in zip(range(step - len(walls) + 1, step + 1), walls, strict=True)
                if not self._was_profiled(s)
            ]
        if len(walls) * 2 >= size:  # a block mostly under the profiler keeps the old reference
            self._ref_ns = block_median(walls)
            self.threshold = anomaly_threshold(
                self._ref_ns, self.settings.anomaly_k, self.settings.anomaly_min_ms
            )
        self._block_end = step + size
        # ranges wholly before the next block can go
        self._all_profiled = [r for r in self._all_profiled if r[1] >= step + 1]

    def _block(self, first: int, last: int) -> list[int]:
        """Walls of steps ``first``..``last`` (the last ones, when the earliest are gone)."""
        end = last - self.first + 1
        if first >= self.first:
            return self.wall[first - self.first : end].tolist()
        older = self._tail[max(0, first - self._tail_first) :].tolist()
        return older + self.wall[: max(0, end)].tolist()

    def _was_profiled(self, step: int) -> bool:
        return any(a <= step <= b for a, b in self._all_profiled)

    def _sample_memory(self, step: int, now: int) -> None:
        reading = read_memory()
        self._mem_due = now + int(self.settings.memory_every_s * 1e9)
        if reading is None:
            return
        kind, a, b = reading
        for name, value in zip(MEMORY_COLUMNS, (step, kind, a, b), strict=True):
            self._mem[name].append(value)

    def _flush(self, *, final: bool, clean: bool = True) -> None:
        """Cut a chunk from the columns and hand it to the writer (which never blocks us)."""
        count = len(self.wall)
        now = _perf_ns()
        self._flush_due = now + int(self.settings.chunk_seconds * 1e9)
        if os.getpid() != self._pid:  # a forked child does not write its parent's series
            self.wall, self.data = array.array("q"), array.array("q")
            return
        if count == 0 and not final:
            return
        windows, later = _windows_within(self._windows, self.first + count - 1, final=final)
        header = {
            **self._header,
            "format": FORMAT,
            "kind": "stepdoctor.series",
            "stream": self._stream,
            "seq": self._seq,
            "pid": self._pid,
            "first_step": self.first,
            "count": count,
            "t_end": time.time(),
            "final": final,
            "clean_exit": final and clean,  # the final chunk of a loop that did not raise
            "anomaly": {
                "k": self.settings.anomaly_k,
                "window": self.settings.anomaly_window,
                "warmup": self.settings.anomaly_warmup,
                "capture": self.settings.anomaly_capture,
                "min_ms": self.settings.anomaly_min_ms,
                "post_window": POST_WINDOW_STEPS,
                "slow_steps": self.anomaly_count,
                "median_ms": self._ref_ns / 1e6 if self._ref_ns else None,
            },
            "profiled": self._profiled,
            "windows": windows,
            "anomalies": self._anomalies,
        }
        columns = [("wall_ns", self.wall), ("data_ns", self.data)]
        columns += [(name, self._mem[name]) for name in MEMORY_COLUMNS]
        self._writer.put(f"series-{self._stream}-{self._seq:07d}{SUFFIX}", header, columns)
        self._seq += 1
        self.steps += count
        kept = (self._tail + self.wall)[-self.settings.anomaly_window :]
        self._tail, self._tail_first = kept, self.first + count - len(kept)
        self.first += count
        self.wall, self.data = array.array("q"), array.array("q")
        self._mem = {name: array.array("q") for name in MEMORY_COLUMNS}
        self._profiled, self._windows, self._anomalies = [], later, []


def _windows_within(
    windows: list[dict[str, Any]], last: int, *, final: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the windows this chunk names, those left for the next). A chunk names steps up to ``last``
    (the reader refuses a window past it): a window reaching further waits for the next chunk; in
    the final chunk (a loop that raised mid-window) it is cut at the last timed step, or dropped
    when none of its steps was timed (its trace is still delivered)."""
    now: list[dict[str, Any]] = []
    later: list[dict[str, Any]] = []
    for window in windows:
        first_step, last_step = window.get("first_step"), window.get("last_step")
        if first_step is None or last_step is None or last_step <= last:
            now.append(window)
        elif not final:
            later.append(window)
        elif first_step <= last:
            now.append({**window, "last_step": last})
    return now, later


def encode_chunk(header: dict[str, Any], columns: list[tuple[str, array.array[int]]]) -> bytes:
    """One chunk's bytes: magic, header length, header JSON, zlib of the little-endian columns."""
    header = {**header, "columns": [[name, "<i8", len(values)] for name, values in columns]}
    raw = bytearray()
    for _, values in columns:
        if not _LITTLE:  # pragma: no cover - big-endian hosts
            values = array.array("q", values)
            values.byteswap()
        raw += values.tobytes()
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + zlib.compress(bytes(raw), 1)


@guarded()
def _encode_safely(header: dict[str, Any], columns: list[tuple[str, array.array[int]]]) -> bytes | None:
    return encode_chunk(header, columns)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def read_memory() -> tuple[int, int, int] | None:
    """(kind, a, b): CUDA allocated and reserved bytes when CUDA is in use, else (RSS, -1)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        stats = cuda.memory_stats()  # one dict for both (memory_allocated() builds it each call)
        return (
            MEM_CUDA,
            int(stats.get("allocated_bytes.all.current", 0)),
            int(stats.get("reserved_bytes.all.current", 0)),
        )
    try:
        with open("/proc/self/statm", "rb") as fh:
            return MEM_RSS, int(fh.read().split()[1]) * _PAGE, -1
    except (OSError, ValueError, IndexError):
        return None


class _ChunkWriter:
    """A daemon thread writing chunks into the run's spool folder; a chunk that cannot be written
    (full disk) is kept in memory and tried again, up to ``MAX_PENDING`` chunks."""

    MAX_PENDING = 1000
    RETRY_S = 5.0

    def __init__(
        self, run_dir: Callable[[], Path | None], on_written: Callable[[], None] | None = None
    ) -> None:
        self._run_dir = run_dir
        self._on_written = on_written
        self._queue: queue.SimpleQueue[tuple[str, dict[str, Any], list[tuple[str, array.array[int]]]] | None]
        self._queue = queue.SimpleQueue()
        self._pending: list[tuple[str, bytes]] = []
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.dropped = 0  # chunks given up after MAX_PENDING unwritable ones

    def put(self, name: str, header: dict[str, Any], columns: list[tuple[str, array.array[int]]]) -> None:
        """Queue a chunk; encoding (JSON, zlib) and writing happen on the writer thread."""
        self._queue.put((name, header, columns))
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="stepdoctor-series", daemon=True)
                    self._thread.start()

    def close(self, timeout: float) -> int:
        """Write what is queued within ``timeout`` s; returns how many chunks were not written."""
        thread = self._thread
        if thread is None:
            return 0
        self._queue.put(None)
        thread.join(max(0.0, timeout))
        if thread.is_alive():
            return self._queue.qsize() + len(self._pending) + 1
        return len(self._pending)

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.RETRY_S if self._pending else None)
            except queue.Empty:
                item = ("", {}, [])  # time to try the pending chunks again
            if item is not None and item[0]:
                data = _encode_safely(item[1], item[2])
                if data is not None:
                    self._pending.append((item[0], data))
                if len(self._pending) > self.MAX_PENDING:
                    self.dropped += 1
                    self._pending.pop(0)
            self._write_pending()
            if item is None:
                return

    @guarded()
    def _write_pending(self) -> None:
        directory = self._run_dir()
        written = 0
        try:
            written = self._write_some(directory)
        finally:
            if written and self._on_written is not None:
                self._on_written()

    def _write_some(self, directory: Path | None) -> int:
        written = 0
        while self._pending and directory is not None:
            name, data = self._pending[0]
            try:
                directory.mkdir(parents=True, exist_ok=True)
                tmp = directory / f".{name}.{os.getpid()}.partial"
                with open(tmp, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, directory / name)
            except OSError as exc:
                say(
                    f"stepdoctor: cannot write the step series to {directory} ({exc.strerror or exc}); "
                    "kept in memory and tried again, training continues",
                    key=f"spool-write:{directory}:{exc.errno}",  # the profiler's key: one line per folder
                )
                return written
            self._pending.pop(0)
            written += 1
        return written


# --- the DataLoader's wait ----------------------------------------------------------------------

#: Marks the classes made here; their instances hold nothing of ours (the recorder lives on the
#: class), so copying or pickling a watched loader gives a plain, untimed one.
_TIMED = "_stepdoctor_timed"
_LOADER_CLASSES: dict[tuple[type, int], type] = {}
_ITER_CLASSES: dict[tuple[type, int], type] = {}


def _original(cls: type) -> type:
    while cls.__dict__.get(_TIMED):
        cls = cls.__mro__[1]
    return cls


@guarded(default=False)
def time_loader(loader: Any, recorder: SeriesRecorder) -> bool:
    """Measure the time the loop waits in ``loader``'s ``__next__`` into ``recorder``.

    The loader keeps its identity and ``isinstance``: its class becomes a subclass whose
    ``__iter__`` gives an iterator of a subclass of the usual one, with ``__next__`` timed. Only
    ``torch.utils.data.DataLoader`` objects are touched (a mapping of settings is just metadata).
    """
    data = sys.modules.get("torch.utils.data")
    if data is None or not isinstance(loader, data.DataLoader):
        return False
    cls = _original(type(loader))
    key = (cls, id(recorder))
    timed = _LOADER_CLASSES.get(key)
    if timed is None:
        namespace = {
            "__iter__": _timed_iter(recorder),
            "__reduce_ex__": _reduce_untimed,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            _TIMED: True,
        }
        timed = _LOADER_CLASSES[key] = type(cls.__name__, (cls,), namespace)
    loader.__class__ = timed
    recorder.loader_known()
    return True


def forget_loaders(recorder: SeriesRecorder) -> None:
    """The recorder is done: drop its classes (loaders still using one keep timing into nothing)."""
    for table in (_LOADER_CLASSES, _ITER_CLASSES):
        for key in [k for k in table if k[1] == id(recorder)]:
            del table[key]


def _reduce_untimed(self: Any, protocol: int) -> Any:
    """Copies and pickles of a watched loader are of its own class, untimed (rebuilt by the
    standard library's ``copyreg._reconstructor``, so unpickling needs no stepdoctor)."""
    rebuild: Any = getattr(copyreg, "_reconstructor")  # noqa: B009 - private in typeshed, stable since 2.x
    return rebuild, (_original(type(self)), object, None), dict(self.__dict__)


def _timed_iter(recorder: SeriesRecorder) -> Callable[[Any], Any]:
    def __iter__(self: Any) -> Any:
        parent: Any = type(self).__mro__[1]
        it = parent.__iter__(self)
        # timing is optional: an iterator that refuses a class change is iterated untimed
        with contextlib.suppress(TypeError, AttributeError):
            cls = _original(type(it))
            key = (cls, id(recorder))
            timed = _ITER_CLASSES.get(key)
            if timed is None:
                namespace = {
                    "__next__": _timed_next(getattr(cls, "__next__"), recorder),  # noqa: B009
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                    _TIMED: True,
                }
                timed = _ITER_CLASSES[key] = type(cls.__name__, (cls,), namespace)
            it.__class__ = timed
        return it

    return __iter__


def _timed_next(parent_next: Callable[[Any], Any], recorder: SeriesRecorder) -> Callable[[Any], Any]:
    def __next__(self: Any) -> Any:
        start = _perf_ns()
        try:
            return parent_next(self)
        finally:
            took = _perf_ns() - start
            acc = recorder.data_acc
            recorder.data_acc = acc + took if acc > 0 else took

    return __next__
