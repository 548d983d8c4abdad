"""What holds the memory, from ``[memory]`` events: categories over time, leaks, fragmentation, OOMs.

torch's memory profiler (``torch.profiler._memory_profiler``) labels each tensor by walking the
autograd graph in the live process; a Kineto trace keeps only the allocator's events (address,
signed size, allocated and reserved totals). So the categories are inferred the way a reader of
the trace would, from when each block is allocated and freed relative to the step's phases:

- phases come from the host ops: ``enumerate(DataLoader)`` (input), ``autograd::engine::
  evaluate_function`` (backward: each step's first to last such op), ``Optimizer.step#``
  (optimizer) and ``Optimizer.zero_grad#`` (zero_grad); anything else inside a step is forward;
- a block is an allocation paired with the next free of its address on its device; a free whose
  allocation came before the capture is a block that was already live when it started;
- forward blocks still alive when the backward starts are **activations** (saved for backward);
  forward blocks freed earlier, and any block freed within the phase that made it, are
  **temporaries**; backward blocks that outlive the backward are **gradients**; optimizer blocks
  that outlive the step are **optimizer state**; input blocks are **inputs**;
- what was allocated before the capture and never freed in it is **parameters** and **optimizer
  state**, split by the gradients the capture shows (one gradient per trainable parameter, the
  same size) and the optimizer's state per parameter (Adam: 2, SGD/RMSprop/Adagrad: 1); where the
  capture shows no gradients (``zero_grad(set_to_none=False)`` keeps them) it stays **persistent**
  (parameters, optimizer state and kept gradients together); in inference it is parameters.
The categories at an instant sum to the allocator's own ``Total Allocated`` then: the residual
(events the capture missed) is counted as persistent, so shares always add up to 1.

Everything is per device (each CUDA device, and the host for CPU allocations), in numpy over the
event columns: no per-event Python loop, so large traces pay a few sorts.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass, field

import numpy as np

from ..model import intervals as iv
from ..model.trace import I64, NONE, HostKind, RankTrace, Step, TorchMemoryTimeline
from . import timeline as tl

CATEGORIES: tuple[str, ...] = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "temporaries",
    "inputs",
    "persistent",
)
PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS, TEMPORARIES, INPUTS, PERSISTENT = range(len(CATEGORIES))
# Phases of a step, in the order their ranges win when they overlap.
INPUT, ZERO_GRAD, OPTIMIZER, BACKWARD, FORWARD, OUTSIDE = range(6)

_BACKWARD_RE = re.compile(r"^autograd::engine::evaluate_function")
_OPTIMIZER_RE = re.compile(r"^Optimizer\.step#")
_ZERO_GRAD_RE = re.compile(r"^Optimizer\.zero_grad#")
_INPUT_RE = re.compile(r"^enumerate\(DataLoader\)")
_OPT_CLASS_RE = re.compile(r"^Optimizer\.step#(\w+)\.step")
_MODULE_RE = re.compile(r"^nn\.Module: ")
# Optimizer state per trainable parameter, in parameter sizes (torch.optim's defaults).
STATE_PER_PARAM: dict[str, float] = {
    "Adam": 2,
    "AdamW": 2,
    "Adamax": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adadelta": 2,
    "SGD": 1,  # momentum buffer (none without momentum: the bound, not the value)
    "RMSprop": 1,
    "Adagrad": 1,
    "Rprop": 2,
    "ASGD": 2,
}
DEFAULT_STATE_PER_PARAM = 2.0  # an optimizer we do not know: Adam's, the most common
_MAX_LOOKUPS = 256  # surviving blocks whose allocating op is looked up (the largest)
_LOOKBACK = 512  # ops searched back from a block's allocation for the innermost one enclosing it


@dataclass(frozen=True)
class Blocks:
    """One device's allocations as blocks (allocation, size, free time, category)."""

    device: str
    alloc_ts: I64  # INT64_MIN-like ``before`` for blocks live when the capture started
    free_ts: I64  # ``after`` for blocks never freed in the capture
    size: I64
    category: np.ndarray  # int8 index into CATEGORIES
    phase: np.ndarray  # int8 phase the block was allocated in (OUTSIDE for pre-capture blocks)
    event: I64  # index of the allocating [memory] event (NONE for pre-capture blocks)
    persistent: int  # bytes live before the capture and never freed in it
    split: tuple[int, int, int]  # (parameters, optimizer_state, persistent) of ``persistent``
    basis: str


@dataclass(frozen=True)
class CategoryBreakdown:
    """Allocated memory on one device at one instant, split by category (bytes; sums to ``allocated``)."""

    device: str
    at_ns: int
    allocated: int
    reserved: int  # 0 when the trace has no reserved totals
    bytes: dict[str, int]
    basis: str
    largest: list[dict[str, object]] = field(default_factory=list)  # the largest live blocks, by op

    def share(self, category: str) -> float:
        return self.bytes.get(category, 0) / self.allocated if self.allocated > 0 else 0.0

    def dominant(self) -> str | None:
        top = max(self.bytes.items(), key=lambda kv: kv[1], default=None)
        return top[0] if top and top[1] > 0 else None


@dataclass(frozen=True)
class LeakStats:
    """Allocated memory at the end of each step on one device, and what survives the steps."""

    device: str
    step_end_bytes: list[int]
    growth_per_step: float  # bytes, (last − first) / (steps − 1)
    steady: bool  # every step ends higher, none by less than half the mean rise (``steady_growth``)
    survivors: list[dict[str, object]] = field(default_factory=list)  # by allocating op, largest first


@dataclass(frozen=True)
class FragmentationStats:
    """Reserved against allocated on one CUDA device."""

    device: str
    peak_allocated: int
    peak_reserved: int
    reserved_at_peak: int  # reserved when allocated peaked
    gap_share: float  # (reserved − allocated) / reserved at the allocated peak
    gap_time_share: float  # share of the steps' time with reserved − allocated ≥ that same gap
    capacity: int


@dataclass(frozen=True)
class OutOfMemory:
    """An ``[OutOfMemory]`` event: the request that failed, and what was allocated then."""

    device: str
    at_ns: int
    requested: int
    allocated: int
    reserved: int
    by_category: CategoryBreakdown | None


@dataclass(frozen=True)
class MemoryUse:
    """Per device: categories at the peak, leak and fragmentation statistics; OOM forensics."""

    at_peak: list[CategoryBreakdown] = field(default_factory=list)
    leaks: list[LeakStats] = field(default_factory=list)
    fragmentation: list[FragmentationStats] = field(default_factory=list)
    out_of_memory: list[OutOfMemory] = field(default_factory=list)
    series: list[dict[str, object]] = field(default_factory=list)  # bytes per category over time, per device
    optimizer: str | None = None
    training: bool = False  # the steps run a backward pass

    def peak(self, device: str | None = None) -> CategoryBreakdown | None:
        if device is not None:
            return next((c for c in self.at_peak if c.device == device), None)
        return max(self.at_peak, key=lambda c: c.allocated, default=None)


def device_name(dtype: int, did: int) -> str:
    return f"cuda:{did}" if dtype == 1 else ("cpu" if dtype == 0 else f"dev{dtype}:{did}")


def analyze_memory_use(
    trace: RankTrace, steps: list[Step], *, devices: list[tuple[int, int]], capacities: dict[str, int]
) -> MemoryUse:
    """Categories at each device's peak, step-end growth, reserved-vs-allocated and OOM forensics;
    ``devices``: the (device type, id) pairs of the memory events (``memory._device_keys``)."""
    m = trace.memory
    if not steps or (not len(m) and trace.oom_events is None):
        return MemoryUse()
    phases = _phases(trace, steps)
    optimizer = _optimizer_class(trace)
    use = MemoryUse(optimizer=optimizer, training=phases.has_backward)
    valid = m.total_allocated != NONE
    for dtype, did in devices:
        sel = np.flatnonzero((m.device_type == dtype) & (m.device_id == did))
        if sel.size == 0 or not valid[sel].any():
            continue
        name = device_name(int(dtype), int(did))
        blocks = _blocks(trace, sel, phases, name, optimizer, use.training)
        tot = m.total_allocated[sel]
        ok = tot != NONE
        peak_i = int(sel[ok][int(np.argmax(tot[ok]))])
        timeline = trace.memory_timeline
        if timeline is not None and timeline.device == name:  # torch's own categories: no inference
            use.at_peak.append(torch_breakdown(trace, timeline, blocks, sel, int(m.ts[peak_i])))
            use.series.append(torch_series(timeline, origin_ns=steps[0].start))
        else:
            use.at_peak.append(_breakdown_at(trace, blocks, peak_i))
            use.series.append(category_series(trace, blocks, sel, origin_ns=steps[0].start))
        use.leaks.append(_leak(trace, sel, blocks, steps))
        frag = _fragmentation(trace, sel, steps, name, capacities.get(name, 0))
        if frag is not None:
            use.fragmentation.append(frag)
        use.out_of_memory.extend(_ooms(trace, blocks, int(dtype), int(did), sel))
    if trace.oom_events is not None and not use.out_of_memory:
        o = trace.oom_events  # an OOM on a device whose allocations the capture did not record
        for i in range(min(len(o), 4)):
            use.out_of_memory.append(
                OutOfMemory(
                    device=device_name(int(o.device_type[i]), int(o.device_id[i])),
                    at_ns=int(o.ts[i]),
                    requested=max(int(o.bytes[i]), 0),
                    allocated=max(int(o.total_allocated[i]), 0),
                    reserved=max(int(o.total_reserved[i]), 0),
                    by_category=None,
                )
            )
    return use


# Phases ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Phases:
    starts: I64  # step windows
    ends: I64
    bw_start: I64  # per step: first backward op's start (INT64 max when none)
    bw_end: I64  # per step: last backward op's end (INT64 min when none)
    ranges: dict[int, iv.Intervals]  # INPUT/ZERO_GRAD/OPTIMIZER -> unions of their host ranges
    has_backward: bool

    def step_of(self, ts: I64) -> I64:
        """The step each time falls in, −1 outside every step."""
        idx = self.starts.searchsorted(ts, side="right") - 1
        inside = (idx >= 0) & (ts < self.ends[np.maximum(idx, 0)])
        return np.where(inside, idx, -1)

    def phase_of(self, ts: I64) -> np.ndarray:
        step = self.step_of(ts)
        at = np.maximum(step, 0)
        out = np.full(ts.shape[0], FORWARD, dtype=np.int8)
        out[(ts >= self.bw_start[at]) & (ts <= self.bw_end[at])] = BACKWARD
        for phase in (OPTIMIZER, ZERO_GRAD, INPUT):  # the last written wins
            starts, ends = self.ranges[phase]
            out[tl.in_windows(ts, starts, ends)] = phase
        out[step < 0] = OUTSIDE
        return out


def _phases(trace: RankTrace, steps: list[Step]) -> _Phases:
    starts, ends = tl.step_windows(steps)
    n = len(steps)
    big = np.iinfo(np.int64).max
    bw_start, bw_end = np.full(n, big, np.int64), np.full(n, -big, np.int64)
    h = trace.host
    ranges: dict[int, iv.Intervals] = {}
    kinds = (HostKind.CPU_OP, HostKind.USER_ANNOTATION)
    for phase, pattern, key in (
        (INPUT, _INPUT_RE, "memory_use.input"),
        (ZERO_GRAD, _ZERO_GRAD_RE, "memory_use.zero_grad"),
        (OPTIMIZER, _OPTIMIZER_RE, "memory_use.optimizer"),
    ):
        ranges[phase] = tl.host_union(trace, tl.host_name_mask(trace, pattern, key, *kinds))
    has_backward = False
    if len(h) and n:
        bw = np.flatnonzero(tl.host_name_mask(trace, _BACKWARD_RE, "memory_use.backward", HostKind.CPU_OP))
        if bw.size:
            idx = starts.searchsorted(h.ts[bw], side="right") - 1
            ok = (idx >= 0) & (h.ts[bw] < ends[np.maximum(idx, 0)])
            np.minimum.at(bw_start, idx[ok], h.ts[bw[ok]])
            np.maximum.at(bw_end, idx[ok], h.end[bw[ok]])
            has_backward = bool(ok.any())
    return _Phases(starts, ends, bw_start, bw_end, ranges, has_backward)


def _optimizer_class(trace: RankTrace) -> str | None:
    hits = tl.host_name_mask(
        trace, _OPTIMIZER_RE, "memory_use.optimizer", HostKind.CPU_OP, HostKind.USER_ANNOTATION
    )
    if not hits.any():
        return None
    found = _OPT_CLASS_RE.match(trace.strings[int(trace.host.name[np.flatnonzero(hits)[0]])])
    return found.group(1) if found else None


# Blocks and categories ---------------------------------------------------------------------------

_BEFORE = np.iinfo(np.int64).min
_AFTER = np.iinfo(np.int64).max


def _blocks(
    trace: RankTrace, sel: I64, ph: _Phases, device: str, optimizer: str | None, training: bool
) -> Blocks:
    """Pair each allocation with the next free of its address (module docstring), then categorise."""
    m = trace.memory
    ts, addr, size = m.ts[sel], m.addr[sel], m.bytes[sel]
    order = np.lexsort((np.arange(sel.size), addr))  # by address, then in time (events are time-sorted)
    a, s = addr[order], size[order]
    same_next = np.zeros(order.size, np.bool_)
    same_next[:-1] = a[:-1] == a[1:]
    allocs = s > 0
    paired = allocs & same_next & np.concatenate([s[1:] < 0, [False]])
    alloc_at = order[allocs]  # indices into sel
    free_of = np.full(order.size, _AFTER, np.int64)
    free_of[paired] = ts[order[np.flatnonzero(paired) + 1]]
    free_ts = free_of[allocs]
    # A free not preceded by an allocation of its address: a block live before the capture.
    same_prev = np.zeros(order.size, np.bool_)
    same_prev[1:] = a[1:] == a[:-1]
    prev_alloc = np.zeros(order.size, np.bool_)
    prev_alloc[1:] = s[:-1] > 0
    orphan = (s < 0) & ~(same_prev & prev_alloc)
    pre_at = order[orphan]

    a_ts = ts[alloc_at]
    a_phase = ph.phase_of(a_ts)
    a_step = ph.step_of(a_ts)
    at = np.maximum(a_step, 0)
    step_end = np.where(a_step >= 0, ph.ends[at], a_ts)
    cat = np.full(alloc_at.size, TEMPORARIES, np.int8)
    cat[a_phase == INPUT] = INPUTS
    fwd = a_phase == FORWARD
    has_bw = ph.bw_start[at] < _AFTER
    if training:
        cat[fwd & has_bw & (free_ts >= ph.bw_start[at])] = ACTIVATIONS
    cat[fwd & (free_ts > step_end) & ~has_bw] = PERSISTENT  # inference: kept past the step (caches, outputs)
    cat[(a_phase == BACKWARD) & (free_ts > ph.bw_end[at])] = GRADIENTS
    cat[(a_phase == OPTIMIZER) & (free_ts > step_end)] = OPTIMIZER_STATE
    cat[(a_phase == OUTSIDE) & (free_ts == _AFTER)] = PERSISTENT

    p_ts = ts[pre_at]
    p_phase = ph.phase_of(p_ts)
    p_cat = np.full(pre_at.size, TEMPORARIES, np.int8)
    p_cat[p_phase == ZERO_GRAD] = GRADIENTS
    p_cat[p_phase == BACKWARD] = ACTIVATIONS
    p_cat[p_phase == INPUT] = INPUTS

    first = int(sel[0])
    live_at_start = int(m.total_allocated[first]) - int(m.bytes[first])
    pre_freed = int(-size[pre_at].sum())
    persistent = max(live_at_start - pre_freed, 0) if m.total_allocated[first] != NONE else 0
    split, basis = _split_persistent(persistent, cat, size[alloc_at], free_ts, ph, optimizer, training)
    return Blocks(
        device=device,
        alloc_ts=np.concatenate([a_ts, np.full(pre_at.size, _BEFORE, np.int64)]),
        free_ts=np.concatenate([free_ts, p_ts]),
        size=np.concatenate([size[alloc_at], -size[pre_at]]),
        category=np.concatenate([cat, p_cat]),
        phase=np.concatenate([a_phase, np.full(pre_at.size, OUTSIDE, np.int8)]),
        event=np.concatenate([sel[alloc_at], np.full(pre_at.size, NONE, np.int64)]),
        persistent=persistent,
        split=split,
        basis=basis,
    )


def _split_persistent(
    persistent: int,
    cat: np.ndarray,
    size: I64,
    free_ts: I64,
    ph: _Phases,
    optimizer: str | None,
    training: bool,
) -> tuple[tuple[int, int, int], str]:
    """(parameters, optimizer state, unsplit) of the memory live since before the capture."""
    base = (
        "phases from the host ops (forward, backward, optimizer, DataLoader); blocks from each "
        "address's allocation and free"
    )
    if persistent <= 0:
        return (0, 0, 0), base
    if not training:
        return (
            persistent,
            0,
            0,
        ), base + "; memory live before the capture is the model's weights (inference)"
    # Gradients live at the last step's end: one per trainable parameter, of its size.
    last_end = int(ph.ends[-1]) if ph.ends.size else 0
    grads = int(size[(cat == GRADIENTS) & (free_ts > last_end)].sum())
    if grads <= 0:
        return (0, 0, persistent), base + (
            "; memory live before the capture stays unsplit (parameters, optimizer state, gradients "
            "kept between steps): the capture shows no gradient allocated"
        )
    per = STATE_PER_PARAM.get(optimizer or "", DEFAULT_STATE_PER_PARAM)
    state = int(min(persistent - min(grads, persistent), per * grads))
    params = persistent - state
    return (params, state, 0), base + (
        f"; memory live before the capture: optimizer state up to {per:g}x the gradients "
        f"({optimizer or 'optimizer unknown'}), the rest parameters (gradients match trainable parameters)"
    )


def live_by_category(blocks: Blocks, t: int) -> np.ndarray:
    """Bytes per category live at time ``t`` (the pre-capture remainder included)."""
    live = (blocks.alloc_ts <= t) & (blocks.free_ts > t)
    out = np.bincount(blocks.category[live], weights=blocks.size[live], minlength=len(CATEGORIES))
    out = out.astype(np.int64)
    params, state, rest = blocks.split
    out[PARAMETERS] += params
    out[OPTIMIZER_STATE] += state
    out[PERSISTENT] += rest
    return out


def _breakdown_at(trace: RankTrace, blocks: Blocks, i: int) -> CategoryBreakdown:
    """Categories at event ``i`` (after it), reconciled with the allocator's total then."""
    m = trace.memory
    t = int(m.ts[i])
    found = _reconciled(blocks, t, int(m.total_allocated[i]), max(int(m.total_reserved[i]), 0))
    return dataclasses.replace(found, largest=_largest_live(trace, blocks, t))


def _largest_live(trace: RankTrace, blocks: Blocks, t: int, top: int = 5) -> list[dict[str, object]]:
    """The ``top`` largest blocks allocated in the capture and live at ``t``: size, category, op."""
    live = np.flatnonzero((blocks.alloc_ts <= t) & (blocks.free_ts > t) & (blocks.event != NONE))
    if live.size == 0:
        return []
    live = live[np.argsort(-blocks.size[live], kind="stable")[:top]]
    ops = _innermost(trace, blocks.alloc_ts[live], trace.host_kind(HostKind.CPU_OP))
    return [
        {"bytes": int(blocks.size[i]), "category": CATEGORIES[int(blocks.category[i])], "op": op or None}
        for i, op in zip(live.tolist(), ops, strict=True)
    ]


def _reconciled(blocks: Blocks, t: int, allocated: int, reserved: int) -> CategoryBreakdown:
    by = live_by_category(blocks, t)
    seen = int(by.sum())
    if allocated > seen:
        by[PERSISTENT] += allocated - seen  # allocated before the capture, beyond what it shows
    elif seen > allocated > 0:  # frees the capture missed: scale down, keeping the proportions
        by = np.floor(by * (allocated / seen)).astype(np.int64)
        by[int(np.argmax(by))] += allocated - int(by.sum())
    return CategoryBreakdown(
        device=blocks.device,
        at_ns=t,
        allocated=int(by.sum()),
        reserved=reserved,
        bytes={c: int(by[k]) for k, c in enumerate(CATEGORIES)},
        basis=blocks.basis,
    )


def category_series(
    trace: RankTrace, blocks: Blocks, sel: I64, *, origin_ns: int, max_points: int = 400
) -> dict[str, object]:
    """Bytes per category over time (µs from ``origin_ns``), at ≤ ``max_points`` instants that keep
    each stretch's peak (the maximum total allocated of each time bucket)."""
    m = trace.memory
    ts = m.ts[sel]
    at = ts[peak_keeping(ts, m.total_allocated[sel], max_points)]
    columns = _live_at(blocks, at)
    return {
        "device": blocks.device,
        "t_us": ((at - origin_ns) / 1000.0).round(1).tolist(),
        "categories": {c: columns[:, k].tolist() for k, c in enumerate(CATEGORIES) if columns[:, k].any()},
    }


def peak_keeping(ts: I64, tot: I64, max_points: int) -> I64:
    """Indices of at most ``max_points`` instants of ``ts``: the highest ``tot`` of each of that many
    equal stretches of time, so a plot keeps every stretch's peak."""
    if ts.size <= max_points:
        return np.arange(ts.size)
    span = max(1, int(ts[-1] - ts[0]))
    bucket = ((ts - ts[0]) * (max_points - 1)) // span
    first = np.flatnonzero(np.diff(bucket, prepend=-1))
    # the instant of each bucket's maximum: its index offset within the bucket
    arg = np.maximum.reduceat(np.where(tot == NONE, -1, tot), first)
    is_max = tot == np.repeat(arg, np.diff(np.append(first, ts.size)))
    return first + np.array(
        [int(np.argmax(is_max[a:b])) for a, b in zip(first, np.append(first[1:], ts.size), strict=True)],
        np.int64,
    )


# torch's memory profiler categories (the agent's ``memory_timeline=True``) ------------------------

#: torch's category -> ours. AUTOGRAD_DETAIL (autograd's own buffers in the backward) are short-lived
#: temporaries; tensors torch leaves uncategorised join what was live all along (persistent).
TORCH_CATEGORIES: dict[str, int] = {
    "PARAMETER": PARAMETERS,
    "OPTIMIZER_STATE": OPTIMIZER_STATE,
    "INPUT": INPUTS,
    "TEMPORARY": TEMPORARIES,
    "ACTIVATION": ACTIVATIONS,
    "GRADIENT": GRADIENTS,
    "AUTOGRAD_DETAIL": TEMPORARIES,
    "UNKNOWN": PERSISTENT,
}
TORCH_BASIS = (
    "torch's memory profiler (the agent's memory_timeline=True): torch's own category of each tensor; "
    "AUTOGRAD_DETAIL counted as temporaries, uncategorised tensors and bytes the allocator holds beyond "
    "torch's tensors as persistent"
)


def _torch_columns(timeline: TorchMemoryTimeline) -> np.ndarray:
    """torch's columns summed into ours: int64 [instants, len(CATEGORIES)]."""
    out = np.zeros((timeline.ts.size, len(CATEGORIES)), np.int64)
    for k, name in enumerate(timeline.categories):
        out[:, TORCH_CATEGORIES.get(name, PERSISTENT)] += timeline.bytes[:, k]
    return out


def torch_breakdown(
    trace: RankTrace, timeline: TorchMemoryTimeline, blocks: Blocks, sel: I64, t: int
) -> CategoryBreakdown:
    """torch's categories at the allocator's peak ``t`` (at the timeline's own peak when it does not
    cover ``t``). ``allocated`` is the larger of torch's tensors and the allocator's total then: the
    allocator's surplus (rounding, workspaces, blocks made before the capture) is persistent; on the
    host, where torch counts only blocks made while recording, torch's sum is the larger."""
    columns = _torch_columns(timeline)
    j = int(timeline.ts.searchsorted(t, side="right")) - 1
    if j < 0 or t > int(timeline.ts[-1]):
        j = int(np.argmax(columns.sum(axis=1)))
        t = int(timeline.ts[j])
    by = columns[j].copy()
    m = trace.memory
    i = int(m.ts[sel].searchsorted(t, side="right")) - 1
    allocated = int(m.total_allocated[sel][i]) if i >= 0 else 0
    reserved = max(int(m.total_reserved[sel][i]), 0) if i >= 0 else 0
    if allocated > int(by.sum()):
        by[PERSISTENT] += allocated - int(by.sum())
    return CategoryBreakdown(
        device=blocks.device,
        at_ns=t,
        allocated=int(by.sum()),
        reserved=reserved,
        bytes={c: int(by[k]) for k, c in enumerate(CATEGORIES)},
        basis=TORCH_BASIS,
        largest=_largest_live(trace, blocks, t),
    )


def torch_series(
    timeline: TorchMemoryTimeline, *, origin_ns: int, max_points: int = 400
) -> dict[str, object]:
    """``category_series`` from torch's timeline: bytes per category over time (µs from ``origin_ns``)."""
    columns = _torch_columns(timeline)
    pick = peak_keeping(timeline.ts, columns.sum(axis=1), max_points)
    columns = columns[pick]
    return {
        "device": timeline.device,
        "t_us": ((timeline.ts[pick] - origin_ns) / 1000.0).round(1).tolist(),
        "categories": {c: columns[:, k].tolist() for k, c in enumerate(CATEGORIES) if columns[:, k].any()},
        "basis": "torch",
    }


def _live_at(blocks: Blocks, at: I64) -> np.ndarray:
    """Bytes per category live at each of ``at`` (sorted): per category, the running sum of +size at
    allocation and −size at free, read at each instant with one ``searchsorted``."""
    out = np.zeros((at.size, len(CATEGORIES)), np.int64)
    for k in range(len(CATEGORIES)):
        mine = blocks.category == k
        if not mine.any():
            continue
        t = np.concatenate([blocks.alloc_ts[mine], blocks.free_ts[mine]])
        d = np.concatenate([blocks.size[mine], -blocks.size[mine]])
        o = np.argsort(t, kind="stable")
        run = np.cumsum(d[o])
        j = t[o].searchsorted(at, side="right") - 1
        out[:, k] = np.where(j >= 0, run[np.maximum(j, 0)], 0)
    params, state, rest = blocks.split
    out[:, PARAMETERS] += params
    out[:, OPTIMIZER_STATE] += state
    out[:, PERSISTENT] += rest
    return out


# Leaks -------------------------------------------------------------------------------------------


def _leak(trace: RankTrace, sel: I64, blocks: Blocks, steps: list[Step]) -> LeakStats:
    m = trace.memory
    ts, tot = m.ts[sel], m.total_allocated[sel]
    ends = np.array([s.end for s in steps], np.int64)
    j = ts.searchsorted(ends, side="right") - 1
    known = (j >= 0) & (tot[np.maximum(j, 0)] != NONE)
    at_end = [int(tot[k]) for k, ok in zip(j.tolist(), known.tolist(), strict=True) if ok]
    growth, steady = steady_growth(np.arange(len(at_end)), np.asarray(at_end, np.int64))
    survivors = _survivors(trace, blocks, steps) if steady else []
    return LeakStats(blocks.device, at_end, growth, steady, survivors)


def steady_growth(step: np.ndarray, value: np.ndarray) -> tuple[float, bool]:
    """Growth per step of memory read at step ends (``value`` at ``step``, increasing steps), and
    whether it is steady: >= 3 readings, each higher than the one before at a rate per step no lower
    than half the mean rate. Growth that levels off (a cache filling, optimizer state made in the
    first steps: one large rise, then small ones) is not steady. The per-trace leak reads consecutive step ends; ``run_growth`` the
    floors of a whole run's samples."""
    if value.size < 3:
        return 0.0, False
    span = np.diff(step).astype(np.float64)
    if (span <= 0).any():
        return 0.0, False
    rate = np.diff(value).astype(np.float64) / span
    growth = float(value[-1] - value[0]) / float(step[-1] - step[0])
    return growth, bool((rate > 0).all() and rate.min() >= 0.5 * float(rate.mean()))


LEAK_MIN_MIB_PER_STEP = 1.0  # steady growth below this is not called a leak (``memory.leak``'s threshold)
RUN_PARTS = 4  # a whole run's memory samples are read as this many consecutive stretches


def run_growth(step: np.ndarray, value: np.ndarray, parts: int = RUN_PARTS) -> tuple[float, bool]:
    """``steady_growth`` over a whole run's memory samples (the agent's step series: allocated or RSS
    at step ends, about once a second): each of ``parts`` consecutive stretches of samples gives its
    lowest reading, the level memory keeps returning to, so a spike or a capture window in between
    does not read as growth. Needs two samples per stretch."""
    if value.size < 2 * parts:
        return 0.0, False
    edges = np.linspace(0, value.size, parts + 1).astype(np.int64)
    lows = [a + int(np.argmin(value[a:b])) for a, b in itertools.pairwise(edges.tolist())]
    return steady_growth(step[lows], value[lows])


def _survivors(trace: RankTrace, blocks: Blocks, steps: list[Step]) -> list[dict[str, object]]:
    """Blocks allocated in a step before the last and still live at the last step's end, by the op
    (and module, with ``with_modules``/``with_stack``) that allocated them: bytes per step."""
    first, last_end = steps[0].start, steps[-1].end
    last_start = steps[-1].start
    keep = (blocks.event != NONE) & (blocks.alloc_ts >= first) & (blocks.alloc_ts < last_start)
    keep &= blocks.free_ts > last_end
    idx = np.flatnonzero(keep)
    if idx.size == 0:
        return []
    idx = idx[np.argsort(-blocks.size[idx], kind="stable")[:_MAX_LOOKUPS]]
    when = blocks.alloc_ts[idx]
    ops = _innermost(trace, when, trace.host_kind(HostKind.CPU_OP))
    modules = _innermost(
        trace, when, tl.host_name_mask(trace, _MODULE_RE, "memory_use.module", HostKind.PYTHON_FUNCTION)
    )
    phase_words = {FORWARD: "forward", BACKWARD: "backward", OPTIMIZER: "optimizer", INPUT: "input"}
    per_steps = max(1, len(steps) - 1)
    groups: dict[tuple[str, str, str], int] = {}
    for k, i in enumerate(idx.tolist()):
        key = (ops[k], modules[k], phase_words.get(int(blocks.phase[i]), "other"))
        groups[key] = groups.get(key, 0) + int(blocks.size[i])
    rows = sorted(groups.items(), key=lambda kv: -kv[1])[:5]
    return [
        {"op": op, "module": mod or None, "phase": phase, "bytes_per_step": round(b / per_steps)}
        for (op, mod, phase), b in rows
    ]


def _innermost(trace: RankTrace, when: I64, mask: np.ndarray) -> list[str]:
    """Name of the latest-starting host event of ``mask`` enclosing each time ("" when none)."""
    h = trace.host
    cand = np.flatnonzero(mask)
    if cand.size == 0:
        return [""] * when.size
    cand = cand[np.argsort(h.ts[cand], kind="stable")]
    starts, stops = h.ts[cand], h.end[cand]
    names: list[str] = []
    for t, j in zip(when.tolist(), starts.searchsorted(when, side="right").tolist(), strict=True):
        lo = max(0, j - _LOOKBACK)
        enclosing = np.flatnonzero(stops[lo:j] >= t)
        names.append(trace.strings[int(h.name[cand[lo + int(enclosing[-1])]])] if enclosing.size else "")
    return names


# Fragmentation -----------------------------------------------------------------------------------


def _fragmentation(
    trace: RankTrace, sel: I64, steps: list[Step], device: str, capacity: int
) -> FragmentationStats | None:
    """Reserved above allocated at the allocated peak: the cache holds more than the most the
    program ever had allocated at once, so its blocks do not fit the requests (fragmentation);
    and how long the gap lasts. Reserved above allocated between peaks is the cache doing its job."""
    m = trace.memory
    tot, res = m.total_allocated[sel], m.total_reserved[sel]
    ok = (tot != NONE) & (res != NONE) & (res > 0)
    if not device.startswith("cuda") or int(np.count_nonzero(ok)) < 2:
        return None
    ts, tot, res = m.ts[sel][ok], tot[ok], res[ok]
    i = int(np.argmax(tot))
    gap_share = max(0.0, (int(res[i]) - int(tot[i])) / int(res[i]))
    starts, ends = tl.step_windows(steps)
    dt = np.diff(ts, append=ts[-1])
    inside = tl.in_windows(ts, starts, ends)
    gap = (res - tot) >= gap_share * res
    span = int(dt[inside].sum())
    return FragmentationStats(
        device=device,
        peak_allocated=int(tot[i]),
        peak_reserved=int(res.max()),
        reserved_at_peak=int(res[i]),
        gap_share=round(gap_share, 4),
        gap_time_share=round(int(dt[inside & gap].sum()) / span, 4) if span > 0 else 0.0,
        capacity=capacity,
    )


# Out of memory -----------------------------------------------------------------------------------


def _ooms(trace: RankTrace, blocks: Blocks, dtype: int, did: int, sel: I64) -> list[OutOfMemory]:
    o = trace.oom_events
    if o is None:
        return []
    mine = np.flatnonzero((o.device_type == dtype) & (o.device_id == did))[:4]
    m = trace.memory
    out = []
    for i in mine.tolist():
        t = int(o.ts[i])
        allocated = int(o.total_allocated[i])
        if allocated == NONE:  # the allocator's total just before the failing request
            j = int(m.ts[sel].searchsorted(t, side="right")) - 1
            allocated = int(m.total_allocated[sel][j]) if j >= 0 else 0
        out.append(
            OutOfMemory(
                device=blocks.device,
                at_ns=t,
                requested=max(int(o.bytes[i]), 0),
                allocated=max(allocated, 0),
                reserved=max(int(o.total_reserved[i]), 0),
                by_category=dataclasses.replace(
                    _reconciled(blocks, t, max(allocated, 0), max(int(o.total_reserved[i]), 0)),
                    largest=_largest_live(trace, blocks, t),
                ),
            )
        )
    return out
