"""Shared selections of a trace as interval sets, and per-step windows.

The diagnosis analyzers all ask the same questions ("when was a compute kernel running?", "when
was the host inside a DataLoader call?"); answering them here keeps one definition of each.
Kernel classes follow HTA (anchors §3): communication = collective kernels (``breakdown``'s
definition), memory = memcpy and memset, computation = every other kernel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from . import intervals as iv
from .breakdown import communication_kernel_mask
from .model import GpuKind, Mask, RankTrace, Step

I64 = iv.I64


def step_windows(steps: list[Step]) -> tuple[I64, I64]:
    starts = np.array([s.start for s in steps], dtype=np.int64)
    ends = np.array([s.end for s in steps], dtype=np.int64)
    return starts, ends


def in_windows(ts: I64, starts: I64, ends: I64) -> Mask:
    """Whether each timestamp falls inside one of the (sorted, disjoint) step windows."""
    if starts.size == 0:
        return np.zeros(ts.shape[0], dtype=np.bool_)
    idx = np.searchsorted(starts, ts, side="right") - 1
    ok = idx >= 0
    res = np.zeros(ts.shape[0], dtype=np.bool_)
    res[ok] = ts[ok] < ends[idx[ok]]
    return res


def step_index(ts: I64, starts: I64, ends: I64) -> I64:
    """Index of the step window holding each timestamp, -1 outside every window."""
    idx = np.searchsorted(starts, ts, side="right") - 1
    ok = idx >= 0
    inside = np.zeros(ts.shape[0], dtype=np.bool_)
    inside[ok] = ts[ok] < ends[idx[ok]]
    return np.where(inside, idx, -1).astype(np.int64)


def host_union(trace: RankTrace, mask: Mask) -> iv.Intervals:
    h = trace.host
    return iv.union(h.ts[mask], h.ts[mask] + h.dur[mask])


def gpu_union(trace: RankTrace, mask: Mask) -> iv.Intervals:
    g = trace.gpu
    return iv.union(g.ts[mask], g.ts[mask] + g.dur[mask])


def host_name_mask(trace: RankTrace, pattern: re.Pattern[str], key: str) -> Mask:
    """Host events whose name matches ``pattern`` (evaluated once per distinct name)."""
    names = trace.name_mask(lambda s: bool(pattern.search(s)), key=("diag", key))
    return names[trace.host.name] if len(trace.host) else np.zeros(0, dtype=np.bool_)


def comm_kernel_mask(trace: RankTrace) -> Mask:
    """Collective kernels, as the breakdown defines them (NCCL names or launched by a collective op)."""
    if not len(trace.gpu):
        return np.zeros(0, dtype=np.bool_)
    key = ("diag", "comm_kernels")
    if key not in trace._mask_cache:
        trace._mask_cache[key] = communication_kernel_mask(trace)
    return trace._mask_cache[key]


def compute_kernel_mask(trace: RankTrace) -> Mask:
    g = trace.gpu
    if not len(g):
        return np.zeros(0, dtype=np.bool_)
    return (g.kind == GpuKind.KERNEL) & ~comm_kernel_mask(trace)


def copy_mask(trace: RankTrace) -> Mask:
    g = trace.gpu
    return (g.kind == GpuKind.MEMCPY) | (g.kind == GpuKind.MEMSET)


def per_step(ivs: iv.Intervals, starts: I64, ends: I64) -> I64:
    return iv.per_window_total(ivs, starts, ends)


def mean_or_zero(a: I64 | np.ndarray) -> float:
    return float(a.mean()) if a.size else 0.0


@dataclass(frozen=True)
class Accounting:
    """Per-step nanoseconds of each kind (arrays aligned with the steps) and the step durations."""

    step_ns: np.ndarray
    kinds: dict[str, np.ndarray]

    def mean_ns(self, kind: str) -> float:
        return mean_or_zero(self.kinds[kind])

    def share(self, kind: str) -> float:
        total = float(self.step_ns.sum())
        return float(self.kinds[kind].sum()) / total if total > 0 else 0.0
