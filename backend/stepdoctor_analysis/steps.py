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

import numpy as np

from .model import I64, GpuKind, HostKind, Mask, RankTrace, Step

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


def find_steps(trace: RankTrace) -> list[Step]:
    """Step windows in time order; one synthetic step (number 0) when the trace has no markers."""
    host = trace.host
    marks = step_marker_mask(trace).nonzero()[0]
    if marks.size == 0:
        return _whole_trace_step(trace)
    marks = marks[host.ts[marks].argsort(kind="stable")]
    numbers = [int(trace.strings[n][len(STEP_PREFIX) :]) for n in host.name[marks].tolist()]
    starts = host.ts[marks]
    ends = host.end[marks]
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
