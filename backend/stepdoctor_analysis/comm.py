"""Collective communication: how much of it the step waits for, and which ranks lag.

Exposed communication is collective-kernel time that no compute kernel overlaps (HTA's
comm/comp overlap, anchors §3); only that part lengthens the step. Across ranks, a straggler is a
rank whose mean step time exceeds the median of the other ranks by more than ``STRAGGLER``: the other ranks
then wait for it inside their collectives, so their own traces look communication-bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import intervals as iv
from . import timeline as tl
from .breakdown import collective_op_mask, communication_kernel_mask, computation_kernel_union
from .model import RankTrace, Step

STRAGGLER = 0.10


@dataclass(frozen=True)
class CommStats:
    kernel_ns_per_step: float = 0.0  # union of collective kernels
    exposed_ns_per_step: float = 0.0
    overlapped_ns_per_step: float = 0.0
    exposed_per_step: list[int] = field(default_factory=list)
    host_collective_ns_per_step: float = 0.0  # CPU-side collectives (gloo on CPU-only jobs)
    top_kernels: list[tuple[str, int, int]] = field(default_factory=list)  # name, count, total ns

    @property
    def overlap_fraction(self) -> float:
        return self.overlapped_ns_per_step / self.kernel_ns_per_step if self.kernel_ns_per_step else 0.0


def analyze_comm(trace: RankTrace, steps: list[Step]) -> CommStats:
    if not steps:
        return CommStats()
    starts, ends = tl.step_windows(steps)
    h = trace.host
    host_coll = 0.0
    if len(h) and collective_op_mask(trace).any():
        host_coll = tl.mean_or_zero(
            tl.per_step(tl.host_union(trace, collective_op_mask(trace)), starts, ends)
        )
    g = trace.gpu
    if not len(g):
        return CommStats(host_collective_ns_per_step=host_coll)
    cmask = communication_kernel_mask(trace)
    if not cmask.any():  # no collective kernels: nothing to time
        return CommStats(exposed_per_step=[0] * len(steps), host_collective_ns_per_step=host_coll)
    comm = tl.comm_union(trace)
    total = tl.per_step(comm, starts, ends)
    overlapped = tl.per_step(iv.intersect(comm, computation_kernel_union(trace)), starts, ends)
    exposed = total - overlapped  # the part no compute kernel hides
    # Per kernel name (ids are dense: counted in place, in id order); float sums of ns are exact.
    names = g.name[cmask]
    all_counts = np.bincount(names)
    ids = all_counts.nonzero()[0]
    counts = all_counts[ids]
    sums = np.bincount(names, weights=g.dur[cmask])[ids].astype(np.int64)
    top = [(trace.strings[int(ids[k])], int(counts[k]), int(sums[k])) for k in (-sums).argsort()[:5]]
    return CommStats(
        kernel_ns_per_step=tl.mean_or_zero(total),
        exposed_ns_per_step=tl.mean_or_zero(exposed),
        overlapped_ns_per_step=tl.mean_or_zero(overlapped),
        exposed_per_step=[int(x) for x in exposed],
        host_collective_ns_per_step=host_coll,
        top_kernels=top,
    )


@dataclass(frozen=True)
class RankSpread:
    step_time_us: dict[int, float]  # rank -> mean step time
    median_us: float
    spread: float  # (slowest - fastest) / median
    stragglers: list[int]


def rank_spread(step_time_us: dict[int, float]) -> RankSpread:
    if not step_time_us:
        return RankSpread({}, 0.0, 0.0, [])
    vals = np.array(list(step_time_us.values()), dtype=np.float64)
    med = float(np.median(vals))
    spread = float((vals.max() - vals.min()) / med) if med > 0 else 0.0
    stragglers = []
    for r, v in step_time_us.items():
        others = [x for q, x in step_time_us.items() if q != r]
        # Compare with the others' median, so two ranks suffice to name the slow one.
        if others and v > float(np.median(others)) * (1 + STRAGGLER):
            stragglers.append(r)
    stragglers.sort()
    return RankSpread(dict(step_time_us), med, spread, stragglers)
