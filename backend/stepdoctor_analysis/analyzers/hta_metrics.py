"""Holistic-Trace-Analysis-compatible metrics (HTA 0.5.0; anchors §3).

Users who know HTA should see the same temporal and idle-time numbers, so the event selection
follows HTA's reader rather than our own step windows:
- GPU events are kernels, memcpy, memset and ``cuda_sync`` events with a stream and correlation id
  (plus ``Event Sync``/``Context Sync``), as HTA's GPU filter selects them;
- when the trace has ≥ 2 ``ProfilerStep`` markers, the last step is dropped: only GPU events whose
  correlation id matches a host event starting before the last step are kept (HTA does this on load);
- kernel kinds by name: communication ``^nccl.*Kernel``, memory ``Memcpy…``/``Memset…``/``dma…``,
  computation = not NCCL, not ``…Memcpy…``/``Memset…``, not ``…Sync…``.

NCCL naming: current NCCL names its kernels ``ncclDevKernel_*`` instead of ``ncclKernel_*``. Tools
that key on ``ncclKernel`` (tb-profiler's name lists, older HTA) count them as compute; we classify
every ``^nccl.*Kernel`` kernel as communication, which HTA 0.5.0's regex also does (tested on both).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..model import intervals as iv
from ..model.arrays import distinct, percentiles
from ..model.steps import launched_ops, launching_call
from ..model.trace import I64, INT64_MIN, GpuKind, Mask, RankTrace
from .timeline import mean_or_zero

KERNEL_WAIT_THRESHOLD_NS = 30_000  # HTA's consecutive_kernel_delay (30 µs)
SHORT_KERNEL_RUNTIME_NS = 50_000  # HTA runtime_cutoff
LAUNCH_DELAY_OUTLIER_NS = 100_000  # HTA launch_delay_cutoff
QUEUE_FULL = 1024  # CUDA's per-stream launch queue depth

_COMM_RE = re.compile(r"^nccl.*Kernel")
_NOT_COMPUTE_RE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
_DEVICE_SYNCS = ("Event Sync", "Context Sync")


def is_communication_kernel(name: str) -> bool:
    """NCCL kernels, old (``ncclKernel_*``) and new (``ncclDevKernel_*``) naming alike."""
    return _COMM_RE.match(name) is not None


def is_compute_kernel(name: str) -> bool:
    # Each alternative of the pattern needs one of these prefixes or words: testing for them first
    # skips the regex's backtracking scans over long templated kernel names.
    if not (name.startswith(("nccl", "Memset")) or "Memcpy" in name or "Sync" in name):
        return True
    return _NOT_COMPUTE_RE.match(name) is None


@dataclass(frozen=True)
class TemporalBreakdown:
    """HTA ``get_temporal_breakdown`` for one rank; times in ns, shares in 0..1 of ``total_ns``."""

    rank: int | None
    idle_ns: int
    compute_ns: int
    non_compute_ns: int
    total_ns: int  # first GPU event start -> last GPU event end

    def share(self, part: str) -> float:
        val = {"idle": self.idle_ns, "compute": self.compute_ns, "non_compute": self.non_compute_ns}[part]
        return val / self.total_ns if self.total_ns else 0.0


@dataclass(frozen=True)
class StreamIdle:
    """HTA ``get_idle_time_breakdown`` for one stream; gaps before each GPU op, in ns."""

    stream: int
    host_wait_ns: int
    kernel_wait_ns: int
    other_ns: int

    @property
    def idle_ns(self) -> int:
        return self.host_wait_ns + self.kernel_wait_ns + self.other_ns

    def ratio(self, part: str) -> float:
        val = {"host_wait": self.host_wait_ns, "kernel_wait": self.kernel_wait_ns, "other": self.other_ns}[
            part
        ]
        return val / self.idle_ns if self.idle_ns else 0.0


@dataclass(frozen=True)
class QueueStats:
    stream: int
    max_length: int
    mean_length: float  # time-weighted between the first and last change
    full_ns: int  # time at or above QUEUE_FULL


@dataclass(frozen=True)
class LaunchStats:
    """HTA ``get_cuda_kernel_launch_stats``: launch call ↔ GPU op pairs joined by correlation."""

    count: int
    launch_delay_ns: dict[str, float]  # p50, p90, p99, max, mean
    cpu_duration_ns: dict[str, float]
    short_kernels: int  # launch call ≤ 50 µs and GPU time shorter than the call
    runtime_outliers: int  # launch call > 50 µs
    launch_delay_outliers: int  # launch delay > 100 µs
    queues: list[QueueStats] = field(default_factory=list)


def hta_gpu_mask(trace: RankTrace) -> Mask:
    """GPU ops (kernel, memcpy, memset, sync) HTA keeps on load, before any per-analysis filter."""
    return trace.memo("hta.gpu_events", lambda: _hta_gpu_mask(trace))


def _hta_gpu_mask(trace: RankTrace) -> Mask:
    gpu = trace.gpu
    is_op = trace.gpu_kind(GpuKind.KERNEL, GpuKind.MEMCPY, GpuKind.MEMSET, GpuKind.SYNC)
    host = trace.host
    marks = trace.host_named(lambda s: "ProfilerStep" in s, "hta.steps")
    # HTA counts distinct ProfilerStep symbols, and with two or more drops the last step's work.
    if distinct(host.name[marks]).size < 2:
        return is_op
    device_sync = trace.gpu_named(lambda s: s in _DEVICE_SYNCS, "hta.devsync")
    last_start = host.ts[marks].max()
    corr = host.correlation[(host.ts < last_start) & (host.correlation >= 0)]
    linked = ((gpu.stream >= 0) & (gpu.correlation >= 0)) | device_sync
    return is_op & linked & iv.member(gpu.correlation, corr)


def _fractional(trace: RankTrace) -> bool:
    """Whether the trace carries sub-µs times (HTA then rounds every event to whole µs)."""
    gpu = trace.gpu
    return trace.memo("hta.fractional", lambda: bool((gpu.ts % 1000).any() or (gpu.dur % 1000).any()))


def _hta_span(ts: I64, end: I64, fractional: bool) -> tuple[I64, I64]:
    """HTA's rounding for ns-resolution traces: start up and end down to whole µs."""
    if not fractional:
        return ts, end
    return _hta_start(ts, fractional), (end // 1000) * 1000


def _hta_start(ts: I64, fractional: bool) -> I64:
    """HTA's rounding of a start time: up to the whole µs in ns-resolution traces."""
    return -(-ts // 1000) * 1000 if fractional else ts


def temporal_breakdown(trace: RankTrace) -> TemporalBreakdown:
    """Idle / compute / non-compute time over the span of GPU activity."""
    gpu = trace.gpu
    sel = hta_gpu_mask(trace) & (gpu.stream != -1)
    if not sel.any():
        return TemporalBreakdown(trace.rank, 0, 0, 0, 0)
    ts, end = _hta_span(gpu.ts[sel], gpu.end[sel], _fractional(trace))
    busy = iv.union(ts, end)
    if busy[0].size == 0:
        return TemporalBreakdown(trace.rank, 0, 0, 0, 0)
    total = int(busy[1][-1] - busy[0][0])
    idle = total - iv.total(busy)
    compute = trace.gpu_named(is_compute_kernel, "hta.compute")[sel]
    compute_ns = iv.total(iv.union(ts[compute], end[compute]))
    return TemporalBreakdown(trace.rank, idle, compute_ns, total - idle - compute_ns, total)


def idle_time_breakdown(trace: RankTrace, threshold_ns: int = KERNEL_WAIT_THRESHOLD_NS) -> list[StreamIdle]:
    """Per stream, classify the gap before each GPU op (HTA's rounding of sub-µs times included).

    host wait: the op's launch call began after the previous op on the stream ended (the CPU was
    late); kernel wait: otherwise, a gap under ``threshold_ns`` (launch latency between back-to-back
    ops); other: the rest. Like HTA, gaps are summed as they are (overlaps count negative).
    """
    gpu, host = trace.gpu, trace.host
    idx = (hta_gpu_mask(trace) & ~trace.gpu_kind(GpuKind.SYNC) & (gpu.stream != -1)).nonzero()[0]
    if idx.size == 0:
        return []
    frac = _fractional(trace)
    call = launching_call(trace)[idx]
    issued = _hta_start(host.ts[np.maximum(call, 0)], frac)
    launched = np.where(call >= 0, issued, INT64_MIN)
    g_ts, g_end = _hta_span(gpu.ts[idx], gpu.end[idx], frac)
    # Every stream in one pass: ops ordered by stream, then start (ties in trace order).
    order = np.lexsort((g_ts, gpu.stream[idx]))
    streams, ts, end, launched = gpu.stream[idx][order], g_ts[order], g_end[order], launched[order]
    gap = ts[1:] - end[:-1]  # before each op; where a stream begins it spans two streams and is not read
    host_wait = launched[1:] > end[:-1]
    kernel_wait = ~host_wait & (gap < threshold_ns)
    first, last = _runs(streams)
    # A stream's gaps lie between its first and last op: differences of prefix sums (exact, int64).
    sums = np.zeros((3, ts.size), dtype=np.int64)
    (gap * host_wait).cumsum(out=sums[0, 1:])
    (gap * kernel_wait).cumsum(out=sums[1, 1:])
    gap.cumsum(out=sums[2, 1:])
    host_ns, kernel_ns, gap_ns = (sums[:, last] - sums[:, first]).tolist()
    return [
        StreamIdle(stream, h, k, g - h - k)
        for stream, h, k, g in zip(streams[first].tolist(), host_ns, kernel_ns, gap_ns, strict=True)
    ]


def _runs(keys: I64) -> tuple[I64, I64]:
    """First and last position of each run of equal values in ``keys`` (non-empty)."""
    first = np.concatenate(([True], keys[1:] != keys[:-1])).nonzero()[0]
    last = np.concatenate((first[1:], [keys.size])) - 1
    return first, last


def kernel_launch_stats(trace: RankTrace) -> LaunchStats:
    """Launch delay, short kernels, outliers and per-stream queue length."""
    gpu, host = trace.gpu, trace.host
    g, c = launched_ops(trace)
    cpu_dur = host.dur[c]
    delay = np.maximum(gpu.ts[g] - (host.ts[c] + cpu_dur), 0)
    gpu_dur = gpu.dur[g]
    return LaunchStats(
        count=int(g.size),
        launch_delay_ns=_summary(delay),
        cpu_duration_ns=_summary(cpu_dur),
        short_kernels=int(np.count_nonzero((cpu_dur <= SHORT_KERNEL_RUNTIME_NS) & (gpu_dur < cpu_dur))),
        runtime_outliers=int(np.count_nonzero(cpu_dur > SHORT_KERNEL_RUNTIME_NS)),
        launch_delay_outliers=int(np.count_nonzero(delay > LAUNCH_DELAY_OUTLIER_NS)),
        queues=_queues(host.ts[c], gpu.ts[g], gpu.stream[g]),
    )


def _summary(x: I64) -> dict[str, float]:
    if x.size == 0:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "mean": 0.0}
    p50, p90, p99 = percentiles(x, (50, 90, 99)).tolist()
    return {"p50": p50, "p90": p90, "p99": p99, "max": float(x.max()), "mean": mean_or_zero(x)}


def _queues(launch_ts: I64, start_ts: I64, streams: I64) -> list[QueueStats]:
    """Queue length per stream: +1 when the launch call is made, -1 when the op starts."""
    out = []
    for stream in distinct(streams).tolist():
        on = streams == stream
        t = np.concatenate((launch_ts[on], start_ts[on]))
        d = _LAUNCH_START.repeat(int(np.count_nonzero(on)))  # +1 per launch, then -1 per start
        # At equal times apply the decrement first, so a launch that starts at once never queues.
        order = np.lexsort((d, t))
        t = t[order]
        level = d[order].cumsum()
        seg = t[1:] - t[:-1]
        span = int(t[-1] - t[0])
        mean = float((level[:-1] * seg).sum() / span) if span > 0 else 0.0
        full = int(seg[level[:-1] >= QUEUE_FULL].sum())
        out.append(QueueStats(stream, int(max(level.max(), 0)), mean, full))
    return out


_LAUNCH_START = np.array([1, -1], dtype=np.int64)
_LAUNCH_START.flags.writeable = False
