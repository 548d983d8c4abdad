"""Shared selections of a trace as interval sets, and per-step windows.

The diagnosis analyzers all ask the same questions ("when was a compute kernel running?", "when
was the host inside a DataLoader call?"); answering them here keeps one definition of each.
Kernel classes follow HTA (anchors §3): communication = collective kernels (``breakdown``'s
definition), memory = memcpy and memset, computation = every other kernel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..model import intervals as iv
from ..model.trace import GpuKind, HostKind, HostMem, Mask, RankTrace, Step
from .breakdown import communication_kernel_mask

I64 = iv.I64


def step_windows(steps: list[Step]) -> tuple[I64, I64]:
    starts = np.array([s.start for s in steps], dtype=np.int64)
    ends = np.array([s.end for s in steps], dtype=np.int64)
    return starts, ends


def in_windows(ts: I64, starts: I64, ends: I64) -> Mask:
    """Whether each timestamp falls inside one of the (sorted, disjoint) step windows."""
    if starts.size == 0:
        return np.zeros(ts.shape[0], dtype=np.bool_)
    idx = starts.searchsorted(ts, side="right") - 1
    return (idx >= 0) & (ts < ends[idx])  # ends[-1] is read for idx -1, and masked off


def host_in_steps(trace: RankTrace, steps: list[Step]) -> Mask:
    """Host events starting inside a step window (cached: most analyzers select them)."""
    return trace.memo(
        ("host_in_steps", tuple(steps)), lambda: in_windows(trace.host.ts, *step_windows(steps))
    )


def gpu_in_steps(trace: RankTrace, steps: list[Step]) -> Mask:
    """GPU events starting inside a step window (cached: most analyzers select them)."""
    return trace.memo(("gpu_in_steps", tuple(steps)), lambda: in_windows(trace.gpu.ts, *step_windows(steps)))


def host_union(trace: RankTrace, mask: Mask) -> iv.Intervals:
    h = trace.host
    return iv.union(h.ts[mask], h.end[mask])


def gpu_union(trace: RankTrace, mask: Mask) -> iv.Intervals:
    g = trace.gpu
    return iv.union(g.ts[mask], g.end[mask])


def host_name_mask(trace: RankTrace, pattern: re.Pattern[str], key: str, *kinds: HostKind) -> Mask:
    """Host events (of ``kinds``, when given) whose name matches ``pattern`` (once per distinct name)."""
    return trace.host_named(pattern.search, ("re", key), *kinds)


def copy_mask(trace: RankTrace) -> Mask:
    return trace.gpu_kind(GpuKind.MEMCPY, GpuKind.MEMSET)


def pageable_copy_mask(trace: RankTrace) -> Mask:
    """Memcpys from pageable host memory: staged through a bounce buffer, so they block the host."""
    return trace.memo(
        "pageable_copies",
        lambda: trace.gpu_kind(GpuKind.MEMCPY) & (trace.gpu.host_mem == int(HostMem.PAGEABLE)),
    )


def comm_union(trace: RankTrace) -> iv.Intervals:
    """When a collective kernel runs."""
    return trace.memo("comm_union", lambda: gpu_union(trace, communication_kernel_mask(trace)))


def per_step(ivs: iv.Intervals, starts: I64, ends: I64) -> I64:
    return iv.per_window_total(ivs, starts, ends)


def rank_by_time(names: np.ndarray, durs: np.ndarray) -> tuple[I64, I64, I64]:
    """(name ids, event counts, total ns) of every name among the events, most total time first
    (ties: lower id first). Name ids are dense, so two bincounts replace a sort-based unique;
    float64 sums of ns are exact."""
    if names.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    all_counts = np.bincount(names)
    ids = all_counts.nonzero()[0]
    sums = np.bincount(names, weights=durs.astype(np.float64))[ids].astype(np.int64)
    order = (-sums).argsort(kind="stable")
    return ids[order], all_counts[ids][order], sums[order]


def mean_or_zero(a: I64 | np.ndarray) -> float:
    # ``a.mean()``'s own arithmetic (a float64 sum, then one division) without its ~5 µs wrapper.
    return float(a.sum(dtype=np.float64)) / a.size if a.size else 0.0


@dataclass(frozen=True)
class Accounting:
    """Per-step nanoseconds of each kind (arrays aligned with the steps) and the step durations."""

    step_ns: np.ndarray
    kinds: dict[str, np.ndarray]
    # How the steps were partitioned, for a drawn step to read its own part back
    # (``step_timeline``) rather than partition it again:
    # - the claim sweep over the steps and the kind of each of its layers, in claim order (a kind
    #   may own several layers; ``Claimed.within``);
    # - whether the device timeline decided (GPU traces), and then the device's idle stretches over
    #   all steps by the kind they were charged to (``diagnose.charge_idle``): a stretch crossing a
    #   step boundary is charged once, the same way in picture and numbers. CPU traces leave the
    #   claim's free time to "other".
    claimed: iv.Claimed = field(repr=False, compare=False)
    layer_kinds: tuple[str, ...] = field(repr=False, compare=False)
    on_gpu: bool
    idle: dict[str, iv.Intervals] = field(default_factory=dict, repr=False, compare=False)
    # Rules and the report ask for these dozens of times: each is computed once, on construction.
    means: dict[str, float] = field(init=False, repr=False, compare=False)
    shares: dict[str, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        total = float(self.step_ns.sum())
        n = self.step_ns.size
        # Every kind's sum in one reduction. Sums of ns are exact in int64, so these equal
        # ``mean_or_zero``'s float64 sums (exact too, below 2**53 ns).
        sums = np.array(list(self.kinds.values())).reshape(len(self.kinds), n).sum(axis=1).tolist()
        means = {k: float(v) / n if n else 0.0 for k, v in zip(self.kinds, sums, strict=True)}
        shares = {k: float(v) / total if total > 0 else 0.0 for k, v in zip(self.kinds, sums, strict=True)}
        object.__setattr__(self, "means", means)  # frozen: the dataclass way to set derived fields
        object.__setattr__(self, "shares", shares)

    def mean_ns(self, kind: str) -> float:
        return self.means[kind]

    def share(self, kind: str) -> float:
        return self.shares[kind]
