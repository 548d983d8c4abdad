"""Collective communication: how much of it the step waits for, by collective type.

Exposed communication is collective time that no compute kernel overlaps (HTA's comm/comp
overlap, anchors §3); only that part lengthens the step. It is reported per collective type
(``collectives.COLLECTIVE_TYPES``), because the fix depends on the type: an exposed all-to-all
(MoE, embedding tables) is not fixed by DDP's bucket size, an FSDP all-gather not by a compression
hook. Each collective kernel takes the type of the typed host op it was launched under
(``nccl:all_to_all``, ``c10d::send``), else the one its own name states, else ``other``.

``arrival_ns_per_step`` is when, from the step's start, the rank reaches its first collective:
with synchronised collectives a rank that arrives late makes the others wait (``ranks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import intervals as iv
from . import timeline as tl
from .breakdown import (
    collective_call_mask,
    collective_op_mask,
    communication_kernel_mask,
    computation_kernel_union,
)
from .collectives import collective_type, library
from .model import I64, Mask, RankTrace, Step
from .steps import launching_call


@dataclass(frozen=True)
class CollectiveStat:
    """One collective type on one rank, per step (ns)."""

    type: str
    calls_per_step: float
    time_ns_per_step: float  # union of its kernels (host ops on CPU-only jobs)
    exposed_ns_per_step: float  # the part no compute kernel overlaps
    overlapped_ns_per_step: float
    libraries: list[str] = field(default_factory=list)  # nccl, deepep, custom_all_reduce, gloo, ...
    top: list[str] = field(default_factory=list)  # its longest kernel/op names

    @property
    def overlap_fraction(self) -> float:
        return self.overlapped_ns_per_step / self.time_ns_per_step if self.time_ns_per_step else 0.0


@dataclass(frozen=True)
class CommStats:
    kernel_ns_per_step: float = 0.0  # union of collective kernels
    exposed_ns_per_step: float = 0.0
    overlapped_ns_per_step: float = 0.0
    exposed_per_step: list[int] = field(default_factory=list)
    host_collective_ns_per_step: float = 0.0  # CPU-side collectives (gloo on CPU-only jobs)
    top_kernels: list[tuple[str, int, int]] = field(default_factory=list)  # name, count, total ns
    by_type: list[CollectiveStat] = field(default_factory=list)  # most exposed first
    arrival_ns_per_step: float | None = None  # step start -> first collective; None without any

    @property
    def overlap_fraction(self) -> float:
        return self.overlapped_ns_per_step / self.kernel_ns_per_step if self.kernel_ns_per_step else 0.0

    @property
    def dominant(self) -> CollectiveStat | None:
        """The type the step waits for most (by exposed time; by total time when all are hidden)."""
        if not self.by_type:
            return None
        return max(self.by_type, key=lambda c: (c.exposed_ns_per_step, c.time_ns_per_step))

    def of_type(self, kind: str) -> CollectiveStat | None:
        return next((c for c in self.by_type if c.type == kind), None)


def analyze_comm(trace: RankTrace, steps: list[Step]) -> CommStats:
    if not steps:
        return CommStats()
    starts, ends = tl.step_windows(steps)
    h = trace.host
    host_coll = 0.0
    calls = collective_call_mask(trace) if len(h) else np.zeros(0, np.bool_)
    if len(h) and collective_op_mask(trace).any():
        host_coll = tl.mean_or_zero(
            tl.per_step(tl.host_union(trace, collective_op_mask(trace)), starts, ends)
        )
    g = trace.gpu
    cmask = communication_kernel_mask(trace) if len(g) else np.zeros(0, np.bool_)
    if not cmask.any():  # no collective kernels: CPU collectives (gloo), if any, by host op
        by_type = _host_types(trace, calls, starts, ends) if calls.any() else []
        first = h.ts[calls] if calls.any() else np.empty(0, np.int64)
        return CommStats(
            exposed_per_step=[0] * len(steps),
            host_collective_ns_per_step=host_coll,
            by_type=by_type,
            arrival_ns_per_step=_arrival(first, starts, ends),
        )
    comm = tl.comm_union(trace)
    compute = computation_kernel_union(trace)
    total = tl.per_step(comm, starts, ends)
    overlapped = tl.per_step(iv.intersect(comm, compute), starts, ends)
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
        by_type=_kernel_types(trace, cmask, calls, compute, starts, ends),
        arrival_ns_per_step=_arrival(g.ts[cmask], starts, ends),
    )


def kernel_collective_types(trace: RankTrace, cmask: Mask, calls: Mask) -> list[str]:
    """Type of each collective kernel (in ``cmask`` order): the enclosing typed host op's, else its name's."""
    g, h = trace.gpu, trace.host
    idx = cmask.nonzero()[0]
    by_name = {int(n): collective_type(trace.strings[int(n)]) for n in np.unique(g.name[idx])}
    out = [by_name[int(n)] or "other" for n in g.name[idx]]
    typed = calls.nonzero()[0] if len(calls) else np.empty(0, np.int64)
    op_type = {int(n): collective_type(trace.strings[int(n)]) for n in np.unique(h.name[typed])}
    typed = typed[[op_type[int(n)] is not None for n in h.name[typed]]]
    launcher = launching_call(trace)[idx]
    if typed.size == 0 or not (launcher >= 0).any():
        return out
    at = np.where(launcher >= 0, h.ts[np.maximum(launcher, 0)], np.iinfo(np.int64).min)
    tid = np.where(launcher >= 0, h.tid[np.maximum(launcher, 0)], -1)
    for thread in np.unique(h.tid[typed]).tolist():  # a launch is inside ops of its own thread only
        ops = typed[h.tid[typed] == thread]
        ops = ops[h.ts[ops].argsort(kind="stable")]
        op_start = h.ts[ops]
        # The enclosing op: among ops starting at or before the launch, the one reaching furthest.
        reach = np.maximum.accumulate(h.end[ops])
        owner = np.zeros(reach.size, np.int64)
        changed = np.concatenate([[0], np.flatnonzero(np.diff(reach)) + 1])
        owner[changed] = changed
        owner = np.maximum.accumulate(owner)
        j = op_start.searchsorted(at, side="right") - 1
        inside = (launcher >= 0) & (tid == thread) & (j >= 0)
        inside[inside] = reach[j[inside]] >= at[inside]
        for k in inside.nonzero()[0].tolist():
            out[k] = op_type[int(h.name[ops[owner[j[k]]]])] or out[k]
    return out


def _kernel_types(
    trace: RankTrace, cmask: Mask, calls: Mask, compute: iv.Intervals, starts: I64, ends: I64
) -> list[CollectiveStat]:
    g = trace.gpu
    idx = cmask.nonzero()[0]
    types = np.array(kernel_collective_types(trace, cmask, calls), dtype=object)
    in_steps = tl.in_windows(g.ts[idx], starts, ends)
    n = max(1, len(starts))
    out = []
    for kind in sorted(set(types.tolist())):
        sel = idx[types == kind]
        union = iv.union(g.ts[sel], g.end[sel])
        total = tl.per_step(union, starts, ends)
        hidden = tl.per_step(iv.intersect(union, compute), starts, ends)
        ids, top = _top_ids(g.name[sel], g.dur[sel])
        names = [trace.strings[i] for i in ids]
        out.append(
            CollectiveStat(
                type=kind,
                calls_per_step=int(np.count_nonzero(in_steps[types == kind])) / n,
                time_ns_per_step=tl.mean_or_zero(total),
                exposed_ns_per_step=tl.mean_or_zero(total - hidden),
                overlapped_ns_per_step=tl.mean_or_zero(hidden),
                libraries=sorted({library(s) for s in set(names)}),
                top=[trace.strings[i] for i in top],
            )
        )
    return sorted(out, key=lambda c: (-c.exposed_ns_per_step, -c.time_ns_per_step, c.type))


def _host_types(trace: RankTrace, calls: Mask, starts: I64, ends: I64) -> list[CollectiveStat]:
    """CPU collectives (gloo): each typed host op's time is all exposed (no device to overlap)."""
    h = trace.host
    idx = calls.nonzero()[0]
    kinds = np.array([collective_type(trace.strings[int(n)]) or "other" for n in h.name[idx]], dtype=object)
    n = max(1, len(starts))
    out = []
    for kind in sorted(set(kinds.tolist())):
        sel = idx[kinds == kind]
        total = tl.per_step(iv.union(h.ts[sel], h.end[sel]), starts, ends)
        ids, top = _top_ids(h.name[sel], h.dur[sel])
        names = [trace.strings[i] for i in ids]
        out.append(
            CollectiveStat(
                type=kind,
                calls_per_step=int(np.count_nonzero(tl.in_windows(h.ts[sel], starts, ends))) / n,
                time_ns_per_step=tl.mean_or_zero(total),
                exposed_ns_per_step=tl.mean_or_zero(total),
                overlapped_ns_per_step=0.0,
                libraries=sorted({library(s) for s in set(names)}),
                top=[trace.strings[i] for i in top],
            )
        )
    return sorted(out, key=lambda c: (-c.exposed_ns_per_step, c.type))


def _top_ids(names: np.ndarray, durs: np.ndarray, k: int = 3) -> tuple[list[int], list[int]]:
    """Distinct name ids, and the ``k`` with the most total time (a bincount, not a Python loop)."""
    ids, inverse = np.unique(names, return_inverse=True)
    totals = np.bincount(inverse, weights=durs)
    return ids.tolist(), ids[(-totals).argsort(kind="stable")[:k]].tolist()


def _arrival(first_ts: np.ndarray, starts: I64, ends: I64) -> float | None:
    """Mean over steps with a collective of (first collective start − step start)."""
    if first_ts.size == 0 or starts.size == 0:
        return None
    ts = np.sort(first_ts)
    k = ts.searchsorted(starts, side="left")
    ok = k < ts.size
    ok[ok] = ts[k[ok]] < ends[ok]
    if not ok.any():
        return None
    return float((ts[k[ok]] - starts[ok]).mean())
