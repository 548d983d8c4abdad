"""Allocator behaviour from ``[memory]`` events and allocator runtime calls.

Per device: peak allocated/reserved against capacity (``deviceProperties.totalGlobalMem`` for
CUDA; host RAM, passed in by the pipeline, for CPU), allocations per step (count and bytes),
churn (bytes allocated per step / peak allocated: how often the working set is re-allocated),
``cudaMalloc``/``cudaFree`` after the first step (the caching allocator missing in steady state),
and ``[OutOfMemory]`` events. TensorBoard warns at peak > 90% of device memory; so do we.

Allocator calls (``cudaMalloc``/``cudaFree``/``hipMalloc``/``hipFree``, ...) are memory time in
every step, the first included: a trace of one or two steps whose host sits in ``hipFree`` while
the GPU idles is memory-bound, whatever else the first step does. The allocator's state is named:
- ``disabled``: the caching allocator is off (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``): every tensor's
  allocation and free reaches the driver, ``DISABLED_CALLS_PER_STEP`` or more calls per step, or
  ``[memory]`` events whose reserved total always equals the allocated total (nothing is cached);
- ``thrashing``: the cache keeps missing after warm-up (fragmentation, ``empty_cache()`` in the
  loop, varying shapes): allocator calls in steady state, fewer than the disabled case;
- ``ok``: no allocator calls after the first step.

Who returns memory to the driver tells the fixes apart: the caching allocator frees cached blocks
itself only when an allocation fails (its retry), inside the op that allocates (an ``aten::empty``
or any ``aten::*`` range encloses the ``cudaFree``); ``torch.cuda.empty_cache()`` records no op, so
its frees run outside any op (typically at the step's end). ``steady_frees_outside_ops_per_step``
counts the latter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..model.arrays import distinct
from ..model.trace import NONE, HostKind, MemoryEvents, RankTrace, Step
from . import timeline as tl
from .memory_use import MemoryUse, analyze_memory_use, device_name

_FREE_API_RE = re.compile(r"^(cuda|hip)Free(Async)?$|^cuMemFree(_v2)?$")
_ALLOC_API_RE = re.compile(
    r"^(cuda|hip)(Malloc|Free|MallocAsync|FreeAsync|MallocHost|FreeHost)$|^cuMem(Alloc|Free)(_v2)?$"
)
PRESSURE = 0.90
DISABLED_CALLS_PER_STEP = 50  # a cached allocator misses a few times per step at most


@dataclass(frozen=True)
class DeviceMemory:
    device: str  # "cuda:0", "cpu"
    peak_allocated: int
    peak_reserved: int  # 0 when the trace has no reserved totals (CPU)
    capacity: int  # 0 when unknown
    allocs_per_step: float
    alloc_bytes_per_step: float
    churn: float  # alloc bytes per step / peak allocated

    @property
    def peak_fraction(self) -> float:
        peak = max(self.peak_allocated, self.peak_reserved)
        return peak / self.capacity if self.capacity > 0 else 0.0


@dataclass(frozen=True)
class MemoryStats:
    devices: list[DeviceMemory] = field(default_factory=list)
    has_events: bool = False
    steady_alloc_calls_per_step: float = 0.0  # cudaMalloc/cudaFree after the first step
    steady_alloc_call_ns_per_step: float = 0.0
    alloc_call_intervals: tuple[np.ndarray, np.ndarray] = field(
        default_factory=lambda: (np.empty(0, np.int64), np.empty(0, np.int64))
    )  # every allocator call inside a step, the first step's included
    out_of_memory: int = 0
    alloc_calls_per_step: float = 0.0  # all steps
    alloc_call_ns_per_step: float = 0.0
    allocator: str | None = None  # "disabled" | "thrashing" | "ok"; None without GPU allocator calls
    allocator_evidence: dict[str, object] = field(default_factory=dict)
    steady_frees_per_step: float = 0.0  # cudaFree & co. after the first step
    steady_frees_outside_ops_per_step: float = 0.0  # ... with no op around them (``empty_cache()``)
    # What holds the memory, leaks, fragmentation, OOM forensics (``memory_use``).
    use: MemoryUse = field(default_factory=MemoryUse)

    def worst(self) -> DeviceMemory | None:
        return max(self.devices, key=lambda d: d.peak_fraction, default=None)


def analyze_memory(trace: RankTrace, steps: list[Step], *, host_memory: int = 0) -> MemoryStats:
    m = trace.memory
    starts, ends = tl.step_windows(steps)
    n = max(1, len(steps))
    devices = []
    if len(m):
        caps = {d.id: d.total_memory for d in trace.devices}
        in_steps = tl.in_windows(m.ts, starts, ends) if steps else np.ones(len(m), dtype=np.bool_)
        for dtype, did in _device_keys(trace):
            sel = (m.device_type == dtype) & (m.device_id == did)
            is_cuda = int(dtype) == 1
            alloc = sel & in_steps & (m.bytes > 0)
            peak_alloc = _peak(m.total_allocated[sel])
            alloc_bytes = float(m.bytes[alloc].sum()) / n
            devices.append(
                DeviceMemory(
                    device=device_name(int(dtype), int(did)),
                    peak_allocated=peak_alloc,
                    peak_reserved=_peak(m.total_reserved[sel]),
                    capacity=caps.get(int(did), 0) if is_cuda else host_memory,
                    allocs_per_step=int(np.count_nonzero(alloc)) / n,
                    alloc_bytes_per_step=alloc_bytes,
                    churn=alloc_bytes / peak_alloc if peak_alloc > 0 else 0.0,
                )
            )
    h = trace.host
    calls = np.zeros(len(h), dtype=np.bool_)
    steady = calls
    if len(h) and steps:
        api = tl.host_name_mask(trace, _ALLOC_API_RE, "alloc_api", HostKind.RUNTIME, HostKind.DRIVER)
        calls = api & tl.host_in_steps(trace, steps)
        if len(steps) > 1:  # only the API calls' times are looked up, not every host event's
            at = api.nonzero()[0]
            steady = np.zeros(len(h), dtype=np.bool_)
            steady[at] = tl.in_windows(h.ts[at], starts[1:], ends[1:])
    steady_steps = max(1, len(steps) - 1)
    per_step = int(np.count_nonzero(calls)) / n
    steady_per_step = int(np.count_nonzero(steady)) / steady_steps
    frees = steady & tl.host_name_mask(trace, _FREE_API_RE, "free_api", HostKind.RUNTIME, HostKind.DRIVER)
    outside = int(np.count_nonzero(frees)) - int(np.count_nonzero(_inside_ops(trace, frees)))
    state, evidence = _allocator_state(
        trace, calls, per_step, steady_per_step if len(steps) > 1 else per_step
    )
    return MemoryStats(
        devices=devices,
        has_events=bool(len(m)),
        steady_alloc_calls_per_step=steady_per_step,
        steady_alloc_call_ns_per_step=int(h.dur[steady].sum()) / steady_steps if len(h) else 0.0,
        alloc_call_intervals=tl.host_union(trace, calls)
        if len(h)
        else (np.empty(0, np.int64), np.empty(0, np.int64)),
        out_of_memory=trace.out_of_memory,
        alloc_calls_per_step=per_step,
        alloc_call_ns_per_step=int(h.dur[calls].sum()) / n if len(h) else 0.0,
        allocator=state,
        allocator_evidence=evidence,
        steady_frees_per_step=int(np.count_nonzero(frees)) / steady_steps,
        steady_frees_outside_ops_per_step=outside / steady_steps,
        use=analyze_memory_use(
            trace,
            steps,
            devices=_device_keys(trace) if len(m) else [],
            capacities={d.device: d.capacity for d in devices},
        ),
    )


def _inside_ops(trace: RankTrace, calls: np.ndarray) -> np.ndarray:
    """The selected host calls that an op on their own thread encloses."""
    h = trace.host
    out = np.zeros(len(h), dtype=np.bool_)
    if not calls.any():
        return out
    ops = trace.host_kind(HostKind.CPU_OP)
    for tid in distinct(h.tid[calls]).tolist():
        mine = np.flatnonzero(ops & (h.tid == tid))
        at = np.flatnonzero(calls & (h.tid == tid))
        if mine.size == 0:
            continue
        mine = mine[h.ts[mine].argsort(kind="stable")]
        # The latest-ending op among those started before each call encloses it if any does.
        reach = np.maximum.accumulate(h.end[mine])
        j = h.ts[mine].searchsorted(h.ts[at], side="right") - 1
        ok = j >= 0
        ok[ok] = reach[j[ok]] >= h.end[at[ok]]
        out[at[ok]] = True
    return out


def _allocator_state(
    trace: RankTrace, calls: np.ndarray, per_step: float, steady_per_step: float
) -> tuple[str | None, dict[str, object]]:
    """``disabled``/``thrashing``/``ok`` (module docstring) and the numbers that say so."""
    if not calls.any():
        return None, {}
    h, m = trace.host, trace.memory
    names = h.name[calls]
    by_api = {
        trace.strings[int(i)]: int(c) for i, c in zip(*np.unique(names, return_counts=True), strict=True)
    }
    evidence: dict[str, object] = {
        "calls_per_step": round(per_step, 2),
        "steady_calls_per_step": round(steady_per_step, 2),
        "by_api": by_api,
    }
    cuda = (m.device_type == 1) & (m.total_allocated != NONE) & (m.total_reserved != NONE) if len(m) else None
    uncached = False
    if cuda is not None and int(np.count_nonzero(cuda)) >= 20:
        same = m.total_reserved[cuda] == m.total_allocated[cuda]
        evidence["reserved_equals_allocated"] = round(float(same.mean()), 3)
        uncached = bool(same.mean() >= 0.95)
    if per_step >= DISABLED_CALLS_PER_STEP or uncached:
        return "disabled", evidence
    return ("thrashing" if steady_per_step > 0 else "ok"), evidence


def _device_keys(trace: RankTrace) -> list[tuple[int, int]]:
    return trace.memo("memory.device_keys", lambda: _distinct_devices(trace.memory))


def _distinct_devices(m: MemoryEvents) -> list[tuple[int, int]]:
    """Distinct (device_type, device_id) pairs, sorted: a 1-D unique on one packed int64 key.

    ``np.unique(axis=1)`` on the stacked pair sorts structured views and costs ~15 ms per 30k events.
    The id is offset into [0, 2**32) so packing keeps the (type, id) lexicographic order for signed values.
    """
    packed = (m.device_type.astype(np.int64) << 32) | (m.device_id.astype(np.int64) + 2**31)
    return [(k >> 32, (k & 0xFFFFFFFF) - 2**31) for k in distinct(packed).tolist()]


def _peak(totals: np.ndarray) -> int:
    valid = totals[totals != NONE]
    return int(valid.max()) if valid.size else 0


def memory_curves(trace: RankTrace, *, origin_ns: int, max_points: int = 400) -> list[dict[str, object]]:
    """Allocated/reserved totals over time per device, downsampled for drawing.

    Each bucket keeps its maximum so peaks survive downsampling; times are µs from ``origin_ns``.
    Devices whose events carry no totals (very old traces) are left out.
    """
    m = trace.memory
    curves: list[dict[str, object]] = []
    if not len(m):
        return curves
    for dtype, did in _device_keys(trace):
        sel = ((m.device_type == dtype) & (m.device_id == did) & (m.total_allocated != NONE)).nonzero()[0]
        if sel.size == 0:
            continue
        sel = sel[m.ts[sel].argsort(kind="stable")]
        ts, alloc, reserved = m.ts[sel], m.total_allocated[sel], m.total_reserved[sel]
        if ts.size > max_points:
            span = max(1, int(ts[-1] - ts[0]))
            bucket = ((ts - ts[0]) * (max_points - 1)) // span
            first = np.diff(bucket, prepend=-1).nonzero()[0]
            ts = ts[first]
            alloc = np.maximum.reduceat(alloc, first)
            reserved = np.maximum.reduceat(reserved, first)
        curves.append(
            {
                "device": device_name(int(dtype), int(did)),  # as in ``devices``: one name per device
                "t_us": ((ts - origin_ns) / 1000.0).round(1).tolist(),
                "allocated": alloc.tolist(),
                "reserved": np.maximum(reserved, 0).tolist() if (reserved != NONE).any() else [],
            }
        )
    return curves
