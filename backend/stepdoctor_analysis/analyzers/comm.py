"""Collective communication: how much of it the step waits for, by collective type.

Exposed communication is collective time that no compute kernel overlaps (HTA's comm/comp
overlap, anchors §3); only that part lengthens the step. It is reported per collective type
(``collectives.COLLECTIVE_TYPES``), because the fix depends on the type: an exposed all-to-all
(MoE, embedding tables) is not fixed by DDP's bucket size, an FSDP all-gather not by a compression
hook. Each collective kernel takes the type recorded by the ``record_param_comms`` op it was
launched under (its ``Collective name``), else that of the typed host op around it
(``nccl:all_to_all``, ``c10d::send``), else the one its own name states, else ``other``. Where the
ops recorded their messages, each type also gets its bytes per step and algorithmic bandwidth
(bytes / collective time, nccl-tests' ``algbw``).

``arrival_ns_per_step`` is when, from the step's start, the rank reaches its first collective:
with synchronised collectives a rank that arrives late makes the others wait (``ranks``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ..model import intervals as iv
from ..model.arrays import distinct
from ..model.collectives import COLLECTIVE_TYPES, collective_type, dtype_bytes, library, recorded_type
from ..model.steps import launching_call
from ..model.trace import I8, I64, NONE, Mask, RankTrace, Step
from . import timeline as tl
from .breakdown import (
    collective_call_mask,
    collective_op_mask,
    communication_kernel_mask,
    computation_kernel_union,
)


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
    # From record_param_comms args (None without them): what its calls moved, and how fast.
    recorded_calls_per_step: float | None = None  # calls whose op recorded "Collective name"
    bytes_per_step: float | None = None  # message bytes: max(In, Out msg nelems) × dtype size
    mean_message_bytes: float | None = None
    algbw_gbps: float | None = None  # bytes_per_step / time_ns_per_step (GB/s); None if NCCL host ops only

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
    ids, counts, sums = (a[:5].tolist() for a in tl.rank_by_time(g.name[cmask], g.dur[cmask]))
    top = [(trace.strings[i], c, t) for i, c, t in zip(ids, counts, sums, strict=True)]
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


def kernel_collective_types(trace: RankTrace, cmask: Mask, calls: Mask) -> np.ndarray:
    """Type of each collective kernel (in ``cmask`` order; an object array of type names).

    The ``Collective name`` recorded by the op it was launched under wins; else the enclosing typed
    host op's (``nccl:all_reduce``); else its own name's; else ``other``.
    """
    g, h = trace.gpu, trace.host
    idx = cmask.nonzero()[0]
    names = g.name[idx]
    # Types per distinct name, then gathered for every kernel at once (names are dense ids).
    by_name = np.empty(len(trace.strings), dtype=object)
    for n in distinct(names).tolist():
        by_name[n] = collective_type(trace.strings[n]) or "other"
    out = by_name[names]
    typed = calls.nonzero()[0] if len(calls) else np.empty(0, np.int64)
    op_type = np.full(len(trace.strings), "", dtype=object)
    for n in distinct(h.name[typed]).tolist():
        op_type[n] = collective_type(trace.strings[n]) or ""
    typed_types = op_type[h.name[typed]]
    typed = typed[typed_types != ""]
    codes = recorded_types(trace)
    recorded = np.flatnonzero(codes >= 0)
    launcher = launching_call(trace)[idx]
    if (typed.size == 0 and recorded.size == 0) or not (launcher >= 0).any():
        return out
    _type_by_enclosing_op(trace, typed, op_type[h.name[typed]], launcher, out)
    _type_by_enclosing_op(
        trace, recorded, np.array(COLLECTIVE_TYPES, dtype=object)[codes[recorded]], launcher, out
    )
    return out


def _type_by_enclosing_op(
    trace: RankTrace, ops: I64, kinds: np.ndarray, launcher: I64, out: np.ndarray
) -> None:
    """Give each kernel (``launcher``: its launching call) the type of the op around its launch."""
    if ops.size == 0:
        return
    h = trace.host
    at = np.where(launcher >= 0, h.ts[np.maximum(launcher, 0)], np.iinfo(np.int64).min)
    tid = np.where(launcher >= 0, h.tid[np.maximum(launcher, 0)], -1)
    for thread in distinct(h.tid[ops]).tolist():  # a launch is inside ops of its own thread only
        on = h.tid[ops] == thread
        mine = ops[on]
        order = h.ts[mine].argsort(kind="stable")
        mine, mine_types = mine[order], kinds[on][order]
        op_start = h.ts[mine]
        # The enclosing op: among ops starting at or before the launch, the one reaching furthest.
        reach = np.maximum.accumulate(h.end[mine])
        owner = np.zeros(reach.size, np.int64)
        changed = np.flatnonzero(np.diff(reach)) + 1  # owner[0] is 0 already
        owner[changed] = changed
        owner = np.maximum.accumulate(owner)
        j = op_start.searchsorted(at, side="right") - 1
        inside = (launcher >= 0) & (tid == thread) & (j >= 0)
        inside[inside] = reach[j[inside]] >= at[inside]
        k = inside.nonzero()[0]
        found = mine_types[owner[j[k]]]
        said = found != ""  # an op of no known type leaves the kernel's own
        out[k[said]] = found[said]


def recorded_types(trace: RankTrace) -> I8:
    """Per host event, the collective type its ``Collective name`` arg records (index into
    ``COLLECTIVE_TYPES``), -1 where none is recorded or the op is bookkeeping (``wait``)."""

    def evaluate() -> I8:
        h = trace.host
        out = np.full(len(h), -1, np.int8)
        idx = np.flatnonzero(h.collective != NONE)
        if idx.size:  # a code per distinct value, gathered for the ops that record one
            sids, which = np.unique(h.collective[idx], return_inverse=True)
            kinds = [recorded_type(trace.strings[sid]) for sid in sids.tolist()]
            codes = np.array([-1 if k is None else COLLECTIVE_TYPES.index(k) for k in kinds], np.int8)
            out[idx] = codes[which]
        return out

    return trace.memo("comm.recorded_types", evaluate)


def message_bytes(trace: RankTrace) -> I64:
    """Per host event, the bytes its recorded collective moves (the larger of its input and output
    messages, ``Out`` for an all-gather and ``In`` for a reduce-scatter); NONE where unknown."""

    def evaluate() -> I64:
        h = trace.host
        out = np.full(len(h), NONE, np.int64)
        idx = np.flatnonzero(h.msg_dtype != NONE)  # only ops that record a message look further
        elems = np.maximum(h.in_nelems[idx], h.out_nelems[idx])
        idx, elems = idx[elems >= 0], elems[elems >= 0]
        if idx.size:
            sids, which = np.unique(h.msg_dtype[idx], return_inverse=True)
            sizes = [dtype_bytes(trace.strings[sid]) for sid in sids.tolist()]
            per = np.array([-1 if b is None else b for b in sizes], np.int64)[which]
            known = per >= 0
            out[idx[known]] = elems[known] * per[known]
        return out

    return trace.memo("comm.message_bytes", evaluate)


def _recorded_bytes(trace: RankTrace, starts: I64, ends: I64) -> dict[str, tuple[int, int, int]]:
    """Per recorded type, over the steps: (calls, calls with a known size, their total bytes)."""
    codes = recorded_types(trace)
    ops = np.flatnonzero(codes >= 0)
    if ops.size == 0:  # no op recorded its collective
        return {}
    ops = ops[tl.in_windows(trace.host.ts[ops], starts, ends)]
    size = message_bytes(trace)[ops]
    out = {}
    for c in distinct(codes[ops]).tolist():
        mine = codes[ops] == c
        known = mine & (size >= 0)
        out[COLLECTIVE_TYPES[c]] = (int(mine.sum()), int(known.sum()), int(size[known].sum()))
    return out


# Device collectives: their host ops only enqueue the transfer, so host time gives no bandwidth.
_DEVICE_LIBRARIES = {"nccl", "rccl", "msccl", "nvshmem"}


def _with_bytes(
    stat: CollectiveStat, recorded: dict[str, tuple[int, int, int]], n: int, *, timed: bool = True
) -> CollectiveStat:
    """``stat`` with what its recorded calls moved (unchanged when none recorded it); its algbw
    only where ``timed`` (its time is the transfer's)."""
    got = recorded.get(stat.type)
    if got is None:
        return stat
    calls, sized, total = got
    per_step = total / n if sized else None
    timed = timed and stat.time_ns_per_step > 0
    return dataclasses.replace(
        stat,
        recorded_calls_per_step=calls / n,
        bytes_per_step=per_step,
        mean_message_bytes=total / sized if sized else None,
        algbw_gbps=(round(per_step / stat.time_ns_per_step, 3) if per_step and timed else None),
    )


def _kernel_types(
    trace: RankTrace, cmask: Mask, calls: Mask, compute: iv.Intervals, starts: I64, ends: I64
) -> list[CollectiveStat]:
    g = trace.gpu
    idx = cmask.nonzero()[0]
    types = kernel_collective_types(trace, cmask, calls)
    in_steps = tl.in_windows(g.ts[idx], starts, ends)
    n = max(1, len(starts))
    out = []
    for kind in sorted(set(types.tolist())):
        sel = idx[types == kind]
        union = iv.union(g.ts[sel], g.end[sel])
        total = tl.per_step(union, starts, ends)
        hidden = tl.per_step(iv.intersect(union, compute), starts, ends)
        calls_per_step = int(np.count_nonzero(in_steps[types == kind])) / n
        out.append(_stat(trace, kind, calls_per_step, total, hidden, g.name[sel], g.dur[sel]))
    recorded = _recorded_bytes(trace, starts, ends)
    out = [_with_bytes(c, recorded, n) for c in out]
    return sorted(out, key=lambda c: (-c.exposed_ns_per_step, -c.time_ns_per_step, c.type))


def _host_types(trace: RankTrace, calls: Mask, starts: I64, ends: I64) -> list[CollectiveStat]:
    """CPU collectives (gloo): each typed host op's time is all exposed (no device to overlap)."""
    h = trace.host
    codes = recorded_types(trace)
    # Ops whose Collective name is bookkeeping (``wait``) move nothing: not a collective of any type.
    idx = np.flatnonzero(calls & ((h.collective == NONE) | (codes >= 0)))
    kinds = np.array(
        [
            COLLECTIVE_TYPES[c] if c >= 0 else collective_type(trace.strings[int(name)]) or "other"
            for name, c in zip(h.name[idx].tolist(), codes[idx].tolist(), strict=True)
        ],
        dtype=object,
    )
    n = max(1, len(starts))
    counted = _outermost(trace, idx) & tl.in_windows(h.ts[idx], starts, ends)
    out = []
    for kind in sorted(set(kinds.tolist())):
        sel = idx[kinds == kind]
        total = tl.per_step(iv.union(h.ts[sel], h.end[sel]), starts, ends)
        calls_per_step = int(np.count_nonzero(counted[kinds == kind])) / n
        out.append(_stat(trace, kind, calls_per_step, total, None, h.name[sel], h.dur[sel]))
    recorded = _recorded_bytes(trace, starts, ends)
    out = [_with_bytes(c, recorded, n, timed=not _DEVICE_LIBRARIES & set(c.libraries)) for c in out]
    return sorted(out, key=lambda c: (-c.exposed_ns_per_step, c.type))


def _stat(
    trace: RankTrace,
    kind: str,
    calls_per_step: float,
    total: I64,
    hidden: I64 | None,
    names: np.ndarray,
    durs: np.ndarray,
) -> CollectiveStat:
    """One collective type's stat from its per-step time; ``hidden`` None: nothing overlaps it (host)."""
    top, _, _ = tl.rank_by_time(names, durs)
    ids = np.sort(top).tolist()
    return CollectiveStat(
        type=kind,
        calls_per_step=calls_per_step,
        time_ns_per_step=tl.mean_or_zero(total),
        exposed_ns_per_step=tl.mean_or_zero(total if hidden is None else total - hidden),
        overlapped_ns_per_step=0.0 if hidden is None else tl.mean_or_zero(hidden),
        libraries=sorted({library(trace.strings[i]) for i in set(ids)}),
        top=[trace.strings[i] for i in top[:3].tolist()],
    )


def _outermost(trace: RankTrace, ops: I64) -> Mask:
    """Of these host ops (in time order), those not started inside another of them on their thread:
    one call is recorded as nested ops (``c10d::allreduce_`` > ``record_param_comms`` > ``gloo:all_reduce``)."""
    h = trace.host
    out = np.ones(ops.size, np.bool_)
    for thread in distinct(h.tid[ops]).tolist():
        sel = np.flatnonzero(h.tid[ops] == thread)
        reach = np.maximum.accumulate(h.end[ops[sel]])  # the host table is sorted by start time
        out[sel[1:]] = h.ts[ops[sel[1:]]] >= reach[:-1]
    return out


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
    return tl.mean_or_zero(ts[k[ok]] - starts[ok])
