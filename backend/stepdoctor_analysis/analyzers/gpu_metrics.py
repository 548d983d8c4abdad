"""GPU utilization, estimated SM efficiency and estimated achieved occupancy (anchors §2).

Definitions follow torch-tb-profiler so numbers match TensorBoard's GPU Summary:
- utilization: time with at least one kernel running / window (memcpy and memset excluded);
- est. SM efficiency: Σ min(1, Σ concurrent blocks_per_SM) × time / window — kernels running at the
  same time add their blocks per SM, capped at 1 (the GPU cannot be more than fully occupied);
- est. achieved occupancy: mean of each kernel's ``est. achieved occupancy %``, weighted by the
  kernel's time inside the window.
The overall window is first step start → last step end; per-step values use each step's window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model import intervals as iv
from ..model.arrays import distinct
from ..model.trace import F32, I64, GpuKind, RankTrace, Step


@dataclass(frozen=True)
class WindowMetrics:
    utilization: float  # fraction of the window with a kernel running, 0..1
    sm_efficiency: float | None  # 0..1; None when no kernel reports blocks per SM
    occupancy: float | None  # percent 0..100; None when no kernel reports occupancy
    kernel_ns: int  # union of kernel time inside the window


@dataclass(frozen=True)
class DeviceMetrics:
    device: int
    overall: WindowMetrics
    per_step: list[WindowMetrics]  # empty unless asked for


@dataclass(frozen=True)
class GpuMetrics:
    window: tuple[int, int]
    devices: list[DeviceMetrics]

    @property
    def utilization(self) -> float | None:
        """Mean over devices (each device is a separate resource the job paid for)."""
        return _mean([d.overall.utilization for d in self.devices])

    @property
    def sm_efficiency(self) -> float | None:
        return _mean([d.overall.sm_efficiency for d in self.devices if d.overall.sm_efficiency is not None])

    @property
    def occupancy(self) -> float | None:
        """Kernel-time-weighted over devices, like the per-device value."""
        pairs = [
            (d.overall.occupancy, d.overall.kernel_ns)
            for d in self.devices
            if d.overall.occupancy is not None
        ]
        tot = sum(w for _, w in pairs)
        if not pairs or tot == 0:
            return None
        return float(sum(v * w for v, w in pairs if v is not None) / tot)


def _mean(vals: list[float]) -> float | None:
    """``np.mean``, and a single device's own value as it is (most traces have one)."""
    if len(vals) < 2:
        return float(vals[0]) if vals else None
    return float(np.mean(vals))


def compute_gpu_metrics(trace: RankTrace, steps: list[Step], *, per_step: bool = False) -> GpuMetrics:
    """Per-device metrics over all steps (and each step's, with ``per_step``); no devices without kernels.

    Per-step values are opt-in: the report does not carry them, and on a small trace their windows
    are a sizeable share of the analysis.
    """
    if not steps:
        return GpuMetrics((0, 0), [])
    lo, hi = steps[0].start, steps[-1].end
    gpu = trace.gpu
    is_kernel = trace.gpu_kind(GpuKind.KERNEL)
    devices = []
    for dev in distinct(gpu.device[is_kernel]).tolist():
        if dev < 0:
            continue
        sel = (is_kernel & (gpu.device == dev)).nonzero()[0]
        ts, end = gpu.ts[sel], gpu.end[sel]
        bps, occ = gpu.blocks_per_sm[sel], gpu.occupancy[sel]
        busy = iv.union(ts, end)
        overall = _window(busy, ts, end, bps, occ, lo, hi)
        # A single step spans the overall window: its metrics are the overall ones.
        windows = [
            overall if (s.start, s.end) == (lo, hi) else _window(busy, ts, end, bps, occ, s.start, s.end)
            for s in (steps if per_step else ())
        ]
        devices.append(DeviceMetrics(int(dev), overall, windows))
    return GpuMetrics((lo, hi), devices)


def _window(busy: iv.Intervals, ts: I64, end: I64, bps: F32, occ: F32, lo: int, hi: int) -> WindowMetrics:
    span = hi - lo
    kernel_ns = iv.total(iv.clip(busy, lo, hi))
    if span <= 0:
        return WindowMetrics(0.0, None, None, 0)
    # Only kernels overlapping the window matter; clipping them makes every sum window-local.
    inside = (ts < hi) & (end > lo)
    s = np.clip(ts[inside], lo, hi)
    e = np.clip(end[inside], lo, hi)
    return WindowMetrics(
        utilization=kernel_ns / span,
        sm_efficiency=_sm_efficiency(s, e, bps[inside], span),
        occupancy=_occupancy(s, e, occ[inside]),
        kernel_ns=kernel_ns,
    )


def _sm_efficiency(s: I64, e: I64, bps: F32, span: int) -> float | None:
    ok = np.isfinite(bps) & (bps > 0)  # tb-profiler skips non-positive values
    if not ok.any():
        return None
    s, e, v = s[ok], e[ok], bps[ok].astype(np.float64)
    # Sweep: the level between consecutive boundaries is the sum of running kernels' blocks per SM.
    t = np.concatenate([s, e])
    dv = np.concatenate([v, -v])
    order = t.argsort(kind="stable")
    t, dv = t[order], dv[order]
    level = np.clip(dv.cumsum()[:-1], 0.0, 1.0)
    seg = (t[1:] - t[:-1]).astype(np.float64)
    return float((level * seg).sum() / span)


def _occupancy(s: I64, e: I64, occ: F32) -> float | None:
    ok = np.isfinite(occ) & (occ >= 0)
    w = (e - s)[ok].astype(np.float64)
    if w.sum() <= 0:
        return None
    return float((occ[ok].astype(np.float64) * w).sum() / w.sum())
