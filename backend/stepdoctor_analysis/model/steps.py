"""Training-step windows, defined exactly as torch-tb-profiler 0.4.3 defines them (anchors §2).

Users compare our per-step numbers with TensorBoard's, so the windows must agree:
- a step is a ``ProfilerStep#N`` range (``user_annotation``, or ``Operator``/``cpu_op`` in old traces);
- its end is extended to the last GPU op (kernel, memcpy, memset) launched by a runtime call lying
  wholly inside the host range; its start is no earlier than the previous step's end, and the first
  step starts no earlier than the end of GPU work launched before it;
- trailing steps that launched no GPU work are dropped, and so is the last step when it launched
  < 80% of the previous step's GPU ops (the profiler likely stopped before its kernels were recorded).

Deliberate differences from tb-profiler: launch calls are recognised under every category name
(``cuda_runtime``, ``cuda_driver``/``cuLaunchKernel``, AMD ``hip*``), whereas 0.4.3 only knows the
legacy ``Runtime`` category and so never extends steps on traces from PyTorch ≥ 1.10; and a trace
without step markers is one step over all host and GPU activity (tb-profiler spans only CPU ops).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .arrays import median_of
from .trace import I64, GpuKind, HostKind, Mask, RankTrace, Step

STEP_PREFIX = "ProfilerStep#"
_TAIL_RATIO = 0.8
_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)


def step_marker_mask(trace: RankTrace) -> Mask:
    """Host events that are ``ProfilerStep#N`` markers."""

    def evaluate() -> Mask:
        return trace.host_named(_is_step_name, "steps.marker", HostKind.USER_ANNOTATION, HostKind.CPU_OP)

    return trace.memo("step_markers", evaluate)


def _is_step_name(s: str) -> bool:
    return s.startswith(STEP_PREFIX) and s[len(STEP_PREFIX) :].isdigit()


def launch_mask(trace: RankTrace) -> Mask:
    """Host events that launch GPU work: runtime and driver API calls."""
    return trace.host_kind(HostKind.RUNTIME, HostKind.DRIVER)


def device_op_mask(trace: RankTrace) -> Mask:
    """GPU events that count as device work for step windows (tb-profiler's device nodes)."""
    return trace.gpu_kind(GpuKind.KERNEL, GpuKind.MEMCPY, GpuKind.MEMSET)


def launching_call(trace: RankTrace) -> I64:
    """For each GPU event, the index of the host launch call with its correlation id, else -1.

    Six analyzers ask for it: computed once per trace, cached read-only on it.
    """
    return trace.memo("steps.launching_call", lambda: _launching_call(trace))


def launched_ops(trace: RankTrace) -> tuple[I64, I64]:
    """Device ops with a known launch call (indices into the GPU table), and those calls (cached)."""

    def evaluate() -> tuple[I64, I64]:
        call = launching_call(trace)
        ops = (device_op_mask(trace) & (call >= 0)).nonzero()[0]
        return ops, call[ops]

    return trace.memo("steps.launched_ops", evaluate)


def _launching_call(trace: RankTrace) -> I64:
    host, gpu = trace.host, trace.gpu
    rt = (launch_mask(trace) & (host.correlation >= 0)).nonzero()[0]
    out = np.full(len(gpu), -1, np.int64)
    if rt.size == 0 or len(gpu) == 0:
        return out
    corr = host.correlation[rt]
    # Stable sort: for a repeated correlation id the later call wins, as in tb-profiler's dict.
    order = corr.argsort(kind="stable")
    corr_sorted, rt_sorted = corr[order], rt[order]
    pos = corr_sorted.searchsorted(gpu.correlation, side="right") - 1
    ok = (pos >= 0) & (gpu.correlation >= 0)
    ok[ok] = corr_sorted[pos[ok]] == gpu.correlation[ok]
    out[ok] = rt_sorted[pos[ok]]
    return out


def marker_ranges(trace: RankTrace) -> tuple[list[int], I64, I64]:
    """The ``ProfilerStep#N`` markers' numbers and host ranges, in start order (empty: no markers)."""

    def evaluate() -> tuple[list[int], I64, I64]:
        host = trace.host
        marks = step_marker_mask(trace).nonzero()[0]
        marks = marks[host.ts[marks].argsort(kind="stable")]
        numbers = [int(trace.strings[n][len(STEP_PREFIX) :]) for n in host.name[marks].tolist()]
        return numbers, host.ts[marks], host.end[marks]

    return trace.memo("steps.marker_ranges", evaluate)


def find_steps(trace: RankTrace) -> list[Step]:
    """Step windows in time order; one synthetic step (number 0) when the trace has no markers."""
    numbers, starts, ends = marker_ranges(trace)
    if not numbers:
        return _whole_trace_step(trace)
    return _steps_from_ranges(trace, numbers, starts, ends)


def _steps_from_ranges(trace: RankTrace, numbers: list[int], starts: I64, ends: I64) -> list[Step]:
    """tb-profiler's step windows from host ranges: extended to the GPU work they launched."""
    host = trace.host
    n = starts.size
    linked, calls = launched_ops(trace)
    # The step whose host range wholly contains the launch call (tb-profiler's two-way merge).
    c_start = host.ts[calls]
    c_end = host.end[calls]
    idx = starts.searchsorted(c_start, side="right") - 1
    inside = idx >= 0
    inside[inside] = c_end[inside] <= ends[idx[inside]]
    g_idx = linked[inside]
    s_idx = idx[inside]
    gpu = trace.gpu
    g_start, g_end = gpu.ts[g_idx], gpu.end[g_idx]
    if g_idx.size == 0:
        return [Step(num, s, e) for num, s, e in zip(numbers, starts.tolist(), ends.tolist(), strict=True)]
    matched = np.bincount(s_idx, minlength=n)
    dev_min = np.full(n, _INT64_MAX, np.int64)
    dev_max = np.full(n, _INT64_MIN, np.int64)
    np.minimum.at(dev_min, s_idx, g_start)
    np.maximum.at(dev_max, s_idx, g_end)

    prev_end = int(starts[0])
    if matched[0] > 0:
        unmatched = device_op_mask(trace).copy()
        unmatched[g_idx] = False
        u_end = gpu.end[unmatched]
        before = u_end[u_end < dev_min[0]]
        if before.size:
            prev_end = max(prev_end, int(before.max()))
    steps: list[Step] = []
    for number, start, end, n_matched, last_dev in zip(
        numbers, starts.tolist(), ends.tolist(), matched.tolist(), dev_max.tolist(), strict=True
    ):
        start = max(prev_end, start)
        end = max(end, start) if n_matched == 0 else max(end, last_dev, start)
        steps.append(Step(number, start, end))
        prev_end = end
    return _drop_incomplete_tail(steps, matched)


def _drop_incomplete_tail(steps: list[Step], matched: np.ndarray) -> list[Step]:
    if len(steps) <= 1:
        return steps
    with_gpu = (matched > 0).nonzero()[0]
    if with_gpu.size == 0:
        return steps
    last = int(with_gpu[-1])
    keep = last + 1
    if last > 0 and matched[last - 1] * _TAIL_RATIO > matched[last]:
        keep = last
    return steps[:keep]


def _whole_trace_step(trace: RankTrace) -> list[Step]:
    """No markers: one step from the first to the last host op, launch call or GPU op."""
    host, gpu = trace.host, trace.gpu
    real = ~trace.host_kind(HostKind.OTHER, HostKind.OVERHEAD)
    lo: list[int] = []
    hi: list[int] = []
    if real.any():
        lo.append(int(host.ts[real].min()))
        hi.append(int(host.end[real].max()))
    if len(gpu):
        lo.append(int(gpu.ts.min()))
        hi.append(int(gpu.end.max()))
    if not lo:
        return []
    return [Step(0, min(lo), max(hi))]


# --- iterations without step markers ------------------------------------------------------------

WARMUP_RATIO = 3.0  # a leading iteration this many times the steady median is warm-up (gpuprof: 3×)
MODULE_COVERAGE = 0.5  # a repeated top-level op must cover this much of the host span to be "the step"
REST_COVERAGE = 0.2  # ... and its instances other than the longest this much
_MAX_PERIODS = 64  # candidate kernel-sequence periods tried
_PERIOD_MATCH = 0.9  # fraction of kernels that must repeat one period later
_DATALOADER_NAMES = ("DataLoader", "DataPipe")


@dataclass(frozen=True)
class Iterations:
    """The steady-state steps to analyse, the warm-up set apart, and how they were found.

    ``source``: ``markers`` (ProfilerStep#), ``dataloader`` (each ``DataLoader.__next__`` starts
    one), ``optimizer`` (each ``Optimizer.step`` ends one), ``module`` (a repeated top-level op,
    e.g. the model's forward or a server request), ``kernel-sequence`` (the GPU repeats the same
    kernel sequence), or ``none`` (one span over the whole trace: nothing repeats).
    """

    steps: list[Step]
    warmup: list[Step] = field(default_factory=list)
    source: str = "markers"
    anchor: str = ""

    @property
    def found(self) -> bool:
        return self.source != "none"


def find_iterations(trace: RankTrace) -> Iterations:
    """Steps from markers, else from the trace's own repeating structure; leading warm-up set apart."""
    if step_marker_mask(trace).any():
        steps, warmup = split_warmup(find_steps(trace))
        return Iterations(steps, warmup, "markers", STEP_PREFIX + "N")
    for source, finder in (
        ("dataloader", _dataloader_ranges),
        ("optimizer", _optimizer_ranges),
        ("module", _top_level_ranges),
    ):
        found = finder(trace)
        if found is None:
            continue
        starts, ends, anchor = found
        steps = _steps_from_ranges(trace, list(range(starts.size)), starts, ends)
        if len(steps) >= 2:
            steady, warmup = split_warmup(steps)
            return Iterations(steady, warmup, source, anchor)
    by_kernels = _kernel_sequence_steps(trace)
    if by_kernels is not None:
        pre, steps, anchor = by_kernels
        steady, warmup = split_warmup(steps)
        return Iterations(steady, pre + warmup, "kernel-sequence", anchor)
    return Iterations(_whole_trace_step(trace), [], "none")


def split_warmup(steps: list[Step]) -> tuple[list[Step], list[Step]]:
    """Leading steps longer than ``WARMUP_RATIO`` × the median of the rest (at least two stay)."""
    warm: list[Step] = []
    rest = list(steps)
    while len(rest) >= 3:
        durs = np.array([s.end - s.start for s in rest[1:]], dtype=np.float64)
        if rest[0].end - rest[0].start <= WARMUP_RATIO * median_of(durs):
            break
        warm.append(rest.pop(0))
    return rest, warm


def _activity_span(trace: RankTrace) -> tuple[int, int] | None:
    host = trace.host
    real = ~trace.host_kind(HostKind.OTHER, HostKind.OVERHEAD)
    if not real.any():
        return None
    return int(host.ts[real].min()), int(host.end[real].max())


def _outermost(ts: I64, end: I64) -> tuple[I64, I64]:
    """Drop ranges nested in an earlier one (the same call seen as annotation and python frame)."""
    order = ts.argsort(kind="stable")
    ts, end = ts[order], end[order]
    keep = np.ones(ts.size, dtype=np.bool_)
    reach = np.maximum.accumulate(end)
    keep[1:] = ts[1:] >= reach[:-1]
    return ts[keep], end[keep]


def _named_ranges(trace: RankTrace, predicate: Any, key: str) -> tuple[I64, I64]:
    m = trace.host_named(
        predicate, ("iter", key), HostKind.USER_ANNOTATION, HostKind.CPU_OP, HostKind.PYTHON_FUNCTION
    )
    return _outermost(trace.host.ts[m], trace.host.end[m])


def _dataloader_ranges(trace: RankTrace) -> tuple[I64, I64, str] | None:
    """Each fetch of a batch starts an iteration; the last runs to the end of host activity."""
    ts, _ = _named_ranges(
        trace, lambda s: "__next__" in s and any(d in s for d in _DATALOADER_NAMES), "dataloader"
    )
    span = _activity_span(trace)
    if ts.size < 2 or span is None:
        return None
    ends = np.append(ts[1:], max(span[1], int(ts[-1]) + 1))
    return ts, ends, "DataLoader.__next__"


def _optimizer_ranges(trace: RankTrace) -> tuple[I64, I64, str] | None:
    """Each optimizer step ends an iteration; the first starts with host activity."""
    _, end = _named_ranges(trace, lambda s: s.startswith("Optimizer.step#"), "optimizer")
    span = _activity_span(trace)
    if end.size < 2 or span is None:
        return None
    starts = np.concatenate([[min(span[0], int(end[0]) - 1)], end[:-1]]).astype(np.int64)
    return starts, end, "Optimizer.step"


def _top_level_ranges(trace: RankTrace) -> tuple[I64, I64, str] | None:
    """The outermost host op that repeats, never overlaps itself and covers most of the host span.

    Walks down the nesting levels: a single op wrapping most of the span (``<module>``, a
    benchmark harness, a server's request handler) is not an iteration, so the ops inside it are
    tried next, up to ``_MAX_DEPTH`` levels. Sorted once; each level is a running maximum.
    """
    span = _activity_span(trace)
    h = trace.host
    kinds = trace.host_kind(HostKind.USER_ANNOTATION, HostKind.CPU_OP, HostKind.PYTHON_FUNCTION)
    if span is None or not kinds.any():
        return None
    total = max(span[1] - span[0], 1)
    idx = kinds.nonzero()[0]
    order = idx[np.lexsort((-h.end[idx], h.ts[idx], h.tid[idx]))]
    ts, end, tid = h.ts[order] - span[0], h.end[order] - span[0], h.tid[order]
    # Threads apart by an offset larger than any time: one running maximum covers every thread.
    offset = np.cumsum(np.r_[0, np.diff(tid) != 0]).astype(np.int64) * (int(max(end.max(), 0)) + 1)
    ts_o, end_o = ts + offset, end + offset
    alive = np.ones(order.size, dtype=np.bool_)
    for _ in range(_MAX_DEPTH):
        pos = alive.nonzero()[0]
        if pos.size == 0:
            return None
        reach = np.maximum.accumulate(end_o[pos])
        top = np.ones(pos.size, dtype=np.bool_)
        top[1:] = ts_o[pos[1:]] >= reach[:-1]
        level = pos[top]
        found = _repeated_at(trace, order[level], total)
        if found is not None:
            return found
        # Go one level down only inside ops that wrap most of the span (a harness, not a loop).
        wrappers = level[(end[level] - ts[level]) >= MODULE_COVERAGE * total]
        if wrappers.size == 0:
            return None
        inside = np.zeros(order.size, dtype=np.bool_)
        for w in wrappers.tolist():
            inside |= (ts_o >= ts_o[w]) & (end_o <= end_o[w])
        inside[wrappers] = False
        alive &= inside
    return None


_MAX_DEPTH = 6
_LEAF_OP_PREFIXES = ("aten::", "c10d::", "cuda", "hip", "<built-in method")


def _repeated_at(trace: RankTrace, level: I64, total: int) -> tuple[I64, I64, str] | None:
    """Among one nesting level, the name repeating most (>= 2 instances covering most of the span)."""
    h = trace.host
    n = len(trace.strings)
    names = h.name[level]
    counts = np.bincount(names, minlength=n)
    cover = np.bincount(names, weights=h.dur[level].astype(np.float64), minlength=n) / total
    longest = np.zeros(n, dtype=np.float64)
    np.maximum.at(longest, names, h.dur[level].astype(np.float64) / total)
    # The instances besides the longest must still cover a good part of the span: one long call
    # (a blocking wait, a warm-up) next to a few tiny ones is not a loop.
    candidates = (
        (counts >= 2) & (cover >= MODULE_COVERAGE) & (cover <= 1.0) & (cover - longest >= REST_COVERAGE)
    ).nonzero()[0]
    # A single tensor op (aten::add) is never an iteration, however often it repeats.
    named = [i for i in candidates.tolist() if not trace.strings[i].startswith(_LEAF_OP_PREFIXES)]
    if not named:
        return None
    name_id = int(max(named, key=lambda i: (cover[i], counts[i])))
    sel = level[names == name_id]
    sel = sel[h.ts[sel].argsort(kind="stable")]
    ts, end = h.ts[sel], h.end[sel]
    return ts, np.append(ts[1:], end[-1]), trace.strings[name_id]


def _kernel_sequence_steps(trace: RankTrace) -> tuple[list[Step], list[Step], str] | None:
    """The GPU repeats one kernel sequence: each repetition is an iteration, what precedes it warm-up.

    The period is found from the last kernel (an iteration ends the same way each time): candidate
    periods are its distances to earlier kernels of the same name, and the shortest one with which
    ``_PERIOD_MATCH`` of the tail repeats wins.
    """
    g = trace.gpu
    k = trace.gpu_kind(GpuKind.KERNEL).nonzero()[0]
    if k.size < 4:
        return None
    k = k[g.ts[k].argsort(kind="stable")]
    a = g.name[k]
    n = a.size
    pos = (a == a[-1]).nonzero()[0]
    for p in (n - 1 - pos[::-1][1 : _MAX_PERIODS + 1]).tolist():
        if p < 2 or 2 * p > n:
            continue
        if np.mean(a[n - p :] == a[n - 2 * p : n - p]) < _PERIOD_MATCH:
            continue
        reps = 2
        while (reps + 1) * p <= n and np.mean(
            a[n - (reps + 1) * p : n - reps * p] == a[n - p :]
        ) >= _PERIOD_MATCH:
            reps += 1
        first = n - reps * p
        bounds = [first + i * p for i in range(reps)]
        starts = [int(g.ts[k[b]]) for b in bounds]
        ends = [*starts[1:], int(g.end[k].max())]
        steps = [Step(i, s, e) for i, (s, e) in enumerate(zip(starts, ends, strict=True))]
        pre = [Step(-1, int(g.ts[k[0]]), starts[0])] if first > 0 else []
        return pre, steps, f"{p} kernels ending with {trace.strings[int(a[-1])][:80]}"
    return None
