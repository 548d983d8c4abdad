"""Columnar, typed model of one rank's Kineto trace.

Every analyzer reads these arrays and nothing else, so parsing cost is paid once and analyses stay
vectorised. All times are int64 nanoseconds on one clock per trace (the trace's own origin), so
sums and interval unions are exact; reports convert to microseconds at the edge.
Names are interned: each table's ``name`` column indexes ``RankTrace.strings``; so do the string
args kept (``HostEvents.collective``, ``msg_dtype``, ...), whose values follow the names there.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

# The codes, re-exported: every analyzer reads them from here.
from .kinds import NONE as NONE
from .kinds import CopyKind as CopyKind
from .kinds import GpuKind as GpuKind
from .kinds import HostKind as HostKind
from .kinds import HostMem as HostMem

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]
I8 = npt.NDArray[np.int8]
F32 = npt.NDArray[np.float32]
Mask = npt.NDArray[np.bool_]

_MISSING = object()  # not cached yet (``None`` is a value worth caching)
INT64_MIN = int(np.iinfo(np.int64).min)  # "before everything" (a missing launch time, say)

T = TypeVar("T")


@dataclass(frozen=True)
class HostEvents:
    name: I32
    kind: I8  # HostKind
    ts: I64
    dur: I64
    pid: I64
    tid: I64
    correlation: I64  # runtime/driver calls: id joining to GpuEvents.correlation; else NONE
    external_id: I64  # cpu_op "External id" (links ops to the runtime calls they issue); else NONE
    # record_param_comms args (collectives by what the profiler recorded); NONE where absent.
    in_nelems: I64  # "In msg nelems"
    out_nelems: I64  # "Out msg nelems"
    collective: I32  # "Collective name" ("allreduce", "_allgather_base", ...): index into strings
    msg_dtype: I32  # "dtype" of the message ("Float", "BFloat16", ...): index into strings
    input_dtype: (
        I32  # record_shapes: a matmul-class op's first floating "Input type" ("c10::BFloat16"): strings index
    )
    grad_seq: I64  # a matmul-class op's autograd "Sequence number": NONE unless autograd recorded the op

    def __len__(self) -> int:
        return int(self.ts.shape[0])

    @cached_property
    def end(self) -> I64:
        """``ts + dur``: most analyzers need when events end, so it is computed once (read-only)."""
        return _read_only(self.ts + self.dur)


@dataclass(frozen=True)
class GpuEvents:
    name: I32
    kind: I8  # GpuKind
    ts: I64
    dur: I64
    device: I32
    stream: I64
    correlation: I64
    bytes: I64  # memcpy/memset bytes, else NONE
    copy_kind: I8  # CopyKind
    host_mem: I8  # HostMem
    blocks_per_sm: F32  # NaN when unknown
    occupancy: F32  # "est. achieved occupancy %" in [0, 100], NaN when unknown

    def __len__(self) -> int:
        return int(self.ts.shape[0])

    @cached_property
    def end(self) -> I64:
        """``ts + dur``, computed once (read-only)."""
        return _read_only(self.ts + self.dur)


@dataclass(frozen=True)
class MemoryEvents:
    """``[memory]`` instant events; totals are NONE in very old traces."""

    ts: I64
    device_type: I8  # 0 CPU, 1 CUDA (other values kept as-is)
    device_id: I32
    addr: I64
    bytes: I64  # negative on free
    total_allocated: I64
    total_reserved: I64

    def __len__(self) -> int:
        return int(self.ts.shape[0])


@dataclass(frozen=True)
class DeviceInfo:
    id: int
    name: str
    total_memory: int  # bytes; 0 when unknown
    num_sms: int
    compute_major: int
    compute_minor: int


@dataclass(frozen=True)
class TorchMemoryTimeline:
    """torch's memory profiler timeline of one device, embedded by the agent (``memory_timeline=True``):
    bytes per torch category (PARAMETER, OPTIMIZER_STATE, INPUT, TEMPORARY, ACTIVATION, GRADIENT,
    AUTOGRAD_DETAIL, UNKNOWN) at each instant, on the trace's ns clock."""

    device: str  # "cpu", "cuda:0"
    ts: I64  # ns, increasing
    categories: tuple[str, ...]
    bytes: npt.NDArray[np.int64]  # [len(ts), len(categories)]


@dataclass(frozen=True)
class Step:
    """One training step window, as torch-tb-profiler defines it (anchors §2)."""

    number: int  # N of ProfilerStep#N; 0 for the synthetic single step
    start: int  # ns
    end: int  # ns, extended to the last GPU op launched inside the step


@dataclass
class RankTrace:
    """One rank's trace. Built by the parser; read-only for analyzers."""

    source: str  # file path or a label
    strings: list[str]
    host: HostEvents
    gpu: GpuEvents
    memory: MemoryEvents
    devices: list[DeviceInfo]
    rank: int | None = None
    world_size: int | None = None
    out_of_memory: int = 0  # count of [OutOfMemory] events
    # The [OutOfMemory] events themselves (``bytes``: the request that failed; totals then), in time order.
    oom_events: MemoryEvents | None = None
    format: str = "kineto"  # which generation the parser recognised, e.g. "kineto", "legacy-2021"
    metadata: dict[str, Any] = field(default_factory=dict)  # small top-level keys (schemaVersion, ...)
    distributed: dict[str, Any] = field(default_factory=dict)  # distributedInfo
    # The run metadata our agent embeds as the top-level ``stepdoctor`` object (CPU count,
    # DataLoader settings, devices, torch version, host, tags): ``pipeline.run_metadata`` reads it.
    run_metadata: dict[str, Any] = field(default_factory=dict)
    # torch's own memory categories over time, when the agent embedded them (``memory_use`` prefers them).
    memory_timeline: TorchMemoryTimeline | None = None
    _cache: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)

    def memo(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, evaluated once per trace and key.

        Several analyzers ask the same questions of a trace (which events are kernels, which fall in
        a step, when compute kernels run); answering each once saves repeated passes over the event
        tables. Cached arrays are made read-only, so changing one in place fails loudly instead of
        corrupting what the other analyzers see.
        """
        value: T = self._cache.get(key, _MISSING)
        if value is _MISSING:
            value = self._cache[key] = _read_only_parts(compute())
        return value

    def host_named(self, predicate: Callable[[str], object], key: Hashable, *kinds: HostKind) -> Mask:
        """Host events (of ``kinds``, when given) whose name satisfies ``predicate``.

        The predicate (any truthy result will do, so a compiled regex's ``search`` can be one) runs
        once per distinct name among those events only: GPU kernel names are long C++ templates,
        and most names belong to events of other kinds.
        """
        group = frozenset(kinds)  # one cache entry per set of kinds, however a caller orders them

        def evaluate() -> Mask:
            among = self.host_kind(*kinds) if kinds else None
            return self._named(("host", group), self.host.name, predicate, among)

        return self.memo(("host_named", key, group), evaluate)

    def gpu_named(self, predicate: Callable[[str], object], key: Hashable) -> Mask:
        """GPU events whose name satisfies ``predicate``, evaluated once per distinct GPU name."""
        return self.memo(("gpu_named", key), lambda: self._named(("gpu",), self.gpu.name, predicate, None))

    def _named(
        self, group: Hashable, names: I32, predicate: Callable[[str], object], among: Mask | None
    ) -> Mask:
        def distinct() -> list[int]:
            present = names if among is None else names[among]
            return np.bincount(present, minlength=len(self.strings)).nonzero()[0].tolist()

        strings = self.strings
        used = self.memo(("names_used", group), distinct)
        known = _answers(predicate)
        if known is None:
            hits = [i for i in used if predicate(strings[i])]
        else:
            if len(known) > _MAX_ANSWERS:  # bounded: a long-lived server sees unboundedly many names
                known.clear()
            hits = []
            for i in used:
                s = strings[i]
                said = known.get(s)
                if said is None:
                    said = known[s] = bool(predicate(s))
                if said:
                    hits.append(i)
        if not hits:  # the usual answer: skip building a mask over every event
            return np.zeros(names.shape[0], dtype=np.bool_)
        if len(hits) <= 4:  # a few names: comparing is cheaper than a gather over every event
            mask = names == hits[0]
            for i in hits[1:]:
                mask |= names == i
        else:
            by_name = np.zeros(len(strings), dtype=np.bool_)
            by_name[hits] = True
            mask = by_name[names]
        return mask if among is None else mask & among

    def host_kind(self, *kinds: HostKind) -> Mask:
        """Host events of any of ``kinds`` (cached: most analyzers select by kind)."""
        return self.memo(("host_kind", frozenset(kinds)), lambda: _kind_mask(self.host.kind, kinds))

    def gpu_kind(self, *kinds: GpuKind) -> Mask:
        """GPU events of any of ``kinds`` (cached: most analyzers select by kind)."""
        return self.memo(("gpu_kind", frozenset(kinds)), lambda: _kind_mask(self.gpu.kind, kinds))

    @property
    def has_gpu(self) -> bool:
        return len(self.gpu) > 0


# Answers of stateless name predicates, per predicate and name, kept across traces: traces of one
# model share their (long, templated) kernel and op names, and a dict lookup is ~20x cheaper than
# the substring and regex tests the predicates run.
_ANSWERS: dict[Hashable, dict[str, bool]] = {}
_MAX_ANSWERS = 1 << 16


def _answers(predicate: Callable[[str], object]) -> dict[str, bool] | None:
    """The answer cache of ``predicate``, or None when its answers may depend on more than the name.

    Functions without closure or defaults are keyed by their code (an inline lambda is a new
    object per call, its code is not; it reads module constants only); a compiled pattern's ``search``/``match`` by the pattern.
    """
    owner = getattr(predicate, "__self__", None)
    if isinstance(owner, re.Pattern):
        key: Hashable = (owner, predicate.__name__)
    else:
        code = getattr(predicate, "__code__", None)
        if code is None or predicate.__closure__ is not None or predicate.__defaults__ is not None:
            return None
        key = (code.co_filename, code)  # code compares by content, not by the file it is in
    known = _ANSWERS.get(key)
    if known is None:
        known = _ANSWERS[key] = {}
    return known


def _read_only_parts(value: T) -> T:
    """``value``, with the arrays it is or holds (one level of tuple) made read-only."""
    if isinstance(value, np.ndarray):
        value.setflags(write=False)
    elif isinstance(value, tuple):
        for part in value:
            if isinstance(part, np.ndarray):
                part.setflags(write=False)
    return value


def _read_only(arr: I64) -> I64:
    arr.setflags(write=False)
    return arr


def _kind_mask(column: I8, kinds: tuple[IntEnum, ...]) -> Mask:
    # Compare with plain ints: numpy converts an IntEnum member several times slower than an int.
    mask = column == int(kinds[0])
    for k in kinds[1:]:
        mask |= column == int(k)
    return mask
