"""Host↔device synchronization: where the host blocks, for how long, and which op asked for it.

A sync is costly not for the time the host waits (the GPU is busy then) but because the launch
queue drains: after the call returns the GPU idles until the host has launched new work. The
diagnosis charges that refill bubble to sync (see ``diagnose``); this module finds the calls and
their triggers (``aten::item``/``_local_scalar_dense``, ``.cpu()``/``aten::to`` with DtoH, ...),
by time containment of the runtime call inside the enclosing ``cpu_op`` on the same thread.

Not every blocking call is a user sync. A blocking host-to-device copy (``x.to(device)`` from
pageable memory: the staged ``cudaMemcpyAsync`` and the ``cudaStreamSynchronize`` PyTorch's
``memcpy_and_sync`` adds after it) blocks the host too, but the copy is needed: its fix is pinned
memory and ``non_blocking=True``, so those calls are the transfer's (``htod_blocking_mask``). User
syncs are the device-to-host reads (``.item()``, ``.cpu()``, ``print``) and explicit synchronize
calls: the blocking calls whose last queued work on their thread is not a host-to-device copy.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..model.arrays import distinct, median_of
from ..model.steps import launched_ops, launching_call, marker_ranges
from ..model.trace import CopyKind, GpuKind, HostKind, Mask, RankTrace, Step
from . import timeline as tl
from .transfers import sync_copy_call_mask

_SYNC_API_RE = re.compile(r"^(cuda|hip)(Stream|Device|Event)Synchronize$|^cu(Stream|Ctx|Event)Synchronize$")
# Ops users write that synchronize; reported in preference to their inner helpers.
_TRIGGERS = (
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::is_nonzero",
    "aten::masked_select",
    "aten::unique",
    "aten::_unique2",
    "aten::equal",
    "aten::cpu",
    "aten::to",
    "aten::_to_copy",
    "aten::copy_",
    "aten::tolist",
    "aten::allclose",
    "aten::any",
    "aten::all",
)
_LOOKBACK = 256  # enclosing ops are among the few hundred ops that started just before the call
_MAX_TRIGGER_CALLS = 5_000  # beyond this, name an evenly spaced sample (steps repeat the same syncs)


@dataclass(frozen=True)
class Trigger:
    op: str
    count: int
    blocked_ns: int


def _empty() -> np.ndarray:
    return np.empty(0, np.int64)


@dataclass(frozen=True)
class BlockingCalls:
    """One class of blocking calls in the steps: how many, how long the host blocked, which ops
    asked for them, and when each ran (sorted by end, for the diagnosis's idle charging)."""

    calls_per_step: float = 0.0
    blocked_ns_per_step: float = 0.0
    by_api: dict[str, int] = field(default_factory=dict)  # API name -> call count in steps
    triggers: list[Trigger] = field(default_factory=list)
    call_ends: np.ndarray = field(default_factory=_empty)  # ns, sorted
    call_starts: np.ndarray = field(default_factory=_empty)
    # Aligned with ``call_ends``: whether the call drains the GPU queue (every blocking call but a
    # pageable host-to-device ``cudaMemcpyAsync``, which only stages the data and returns).
    drains: np.ndarray = field(default_factory=lambda: np.empty(0, np.bool_))
    # The user syncs' direction: device-to-host reads (the last queued work on the thread was a DtoH
    # copy: ``.item()``, ``.cpu()``) per step, and their median size; the rest are explicit syncs.
    dtoh_reads_per_step: float = 0.0
    dtoh_read_median_bytes: float = 0.0


@dataclass(frozen=True)
class SyncStats(BlockingCalls):
    """User syncs (DtoH reads, explicit synchronize calls); ``htod``: the blocking host-to-device
    copies, which are the transfer's (module docstring)."""

    htod: BlockingCalls = field(default_factory=BlockingCalls)


def blocking_call_mask(trace: RankTrace) -> np.ndarray:
    """Runtime calls that block the host: explicit syncs, sync memcpy, async copies of pageable memory."""
    h = trace.host
    if not len(h):
        return np.zeros(0, dtype=np.bool_)
    explicit = tl.host_name_mask(trace, _SYNC_API_RE, "sync_api", HostKind.RUNTIME, HostKind.DRIVER)
    mask = explicit | sync_copy_call_mask(trace)
    g = trace.gpu
    if len(g):
        launcher = launching_call(trace)
        pageable = tl.pageable_copy_mask(trace) & (launcher >= 0)
        mask[launcher[pageable]] = True
    return mask


def last_queued(trace: RankTrace) -> np.ndarray:
    """For each host event, the GPU op (index) its thread queued last at or before its start (the
    call's own, for a launch call); -1 when none.

    What a blocking call waits for last is what its thread queued last: a synchronize right after
    a host-to-device copy waits for that copy (``memcpy_and_sync``), one after a device-to-host
    copy is a read. Cached: the sync analysis and the floors ask."""

    def evaluate() -> np.ndarray:
        h = trace.host
        out = np.full(len(h), -1, np.int64)
        ops, calls = launched_ops(trace)
        if calls.size == 0:
            return out
        op_of = np.full(len(h), -1, np.int64)
        op_of[calls] = ops
        launches = distinct(calls)
        for tid in distinct(h.tid[launches]).tolist():
            mine = launches[h.tid[launches] == tid]
            mine = mine[h.ts[mine].argsort(kind="stable")]
            on_thread = (h.tid == tid).nonzero()[0]
            j = h.ts[mine].searchsorted(h.ts[on_thread], side="right") - 1
            ok = j >= 0
            out[on_thread[ok]] = op_of[mine[j[ok]]]
        return out

    return trace.memo("sync.last_queued", evaluate)


def _queued_copy_kind(trace: RankTrace, calls: np.ndarray) -> np.ndarray:
    """The direction (``CopyKind``) of the copy each call waits for last; -1 when it is a kernel."""
    op = last_queued(trace)[calls]
    g = trace.gpu
    safe = np.maximum(op, 0)
    copy = (op >= 0) & (g.kind[safe] == int(GpuKind.MEMCPY)) if len(g) else np.zeros(op.size, np.bool_)
    return np.where(copy, g.copy_kind[safe] if len(g) else -1, -1)


def staging_call_mask(trace: RankTrace) -> Mask:
    """Async launch calls of pageable host-to-device copies: they block while the data is staged,
    then return without waiting for the device (CUDA's API synchronization behaviour)."""

    def evaluate() -> Mask:
        h, g = trace.host, trace.gpu
        out = np.zeros(len(h), np.bool_)
        if not len(g):
            return out
        launcher = launching_call(trace)
        htod = tl.pageable_copy_mask(trace) & (g.copy_kind == int(CopyKind.HTOD)) & (launcher >= 0)
        out[launcher[htod]] = True
        return out & ~sync_copy_call_mask(trace)

    return trace.memo("sync.staging_calls", evaluate)


def htod_blocking_mask(trace: RankTrace) -> Mask:
    """Blocking calls that wait for a host-to-device copy: the transfer's, not user syncs."""
    blocking = blocking_call_mask(trace)
    if not blocking.any():
        return blocking
    out = np.zeros_like(blocking)
    calls = blocking.nonzero()[0]
    out[calls] = _queued_copy_kind(trace, calls) == int(CopyKind.HTOD)
    return out


def analyze_sync(trace: RankTrace, steps: list[Step]) -> SyncStats:
    h = trace.host
    if not len(h) or not steps:
        return SyncStats()
    calls = (blocking_call_mask(trace) & tl.host_in_steps(trace, steps)).nonzero()[0]
    numbers, m_starts, m_ends = marker_ranges(trace)
    if calls.size and numbers:
        # The loop's syncs run inside its ProfilerStep ranges (they tile the loop); a sync after
        # the last one is the profiler's own cudaDeviceSynchronize as it closes the window, which
        # step windows stretched over a device running behind the host would otherwise take in.
        calls = calls[(h.ts[calls] >= m_starts[0]) & (h.ts[calls] < m_ends.max())]
    if calls.size == 0:
        return SyncStats()
    htod = htod_blocking_mask(trace)[calls]
    user = _blocking_calls(trace, calls[~htod], len(steps))
    return SyncStats(**vars(user), htod=_blocking_calls(trace, calls[htod], len(steps)))


def _blocking_calls(trace: RankTrace, calls: np.ndarray, n: int) -> BlockingCalls:
    if calls.size == 0:
        return BlockingCalls()
    h = trace.host
    by_api: dict[str, int] = defaultdict(int)
    counts = np.bincount(h.name[calls])  # name ids are dense: counted in place, in id order
    for name_id in counts.nonzero()[0].tolist():
        by_api[trace.strings[name_id]] += int(counts[name_id])
    call_end = h.end[calls]
    order = call_end.argsort()
    # Each device-to-host read once, whichever of its calls (the staged copy, the synchronize) blocked.
    reads = distinct(last_queued(trace)[calls[_queued_copy_kind(trace, calls) == int(CopyKind.DTOH)]])
    return BlockingCalls(
        calls_per_step=calls.size / n,
        blocked_ns_per_step=int(h.dur[calls].sum()) / n,
        by_api=dict(by_api),
        triggers=_triggers(trace, calls),
        call_ends=call_end[order],
        call_starts=h.ts[calls][order],
        drains=~staging_call_mask(trace)[calls][order],
        dtoh_reads_per_step=reads.size / n,
        dtoh_read_median_bytes=median_of(np.maximum(trace.gpu.bytes[reads], 0)) if reads.size else 0.0,
    )


def _triggers(trace: RankTrace, calls: np.ndarray) -> list[Trigger]:
    """Name each blocking call by the user-facing op that encloses it on the same thread."""
    h = trace.host
    if calls.size > _MAX_TRIGGER_CALLS:
        calls = calls[np.linspace(0, calls.size - 1, _MAX_TRIGGER_CALLS).astype(np.int64)]
    ops = trace.host_kind(HostKind.CPU_OP).nonzero()[0]
    is_trigger = trace.host_named(lambda n: n in _TRIGGERS, "sync_triggers", HostKind.CPU_OP)
    picked = np.full(calls.size, -1, dtype=np.int64)
    call_tid = h.tid[calls]
    for tid in distinct(call_tid).tolist():
        sel = ops[h.tid[ops] == tid]
        if sel.size == 0:
            continue
        sel = sel[h.ts[sel].argsort(kind="stable")]
        mine = (call_tid == tid).nonzero()[0]
        c = calls[mine]
        c_start = h.ts[c]
        c_end = h.end[c]
        sel_start = h.ts[sel]
        sel_end, sel_trigger = h.end[sel], is_trigger[sel]
        hi = sel_start.searchsorted(c_start, side="right")
        # Each call looks back over the ops that started just before it, at most ``_LOOKBACK``.
        # Ops before the first one still running at the call's end enclose nothing (a running
        # maximum of the ends finds it), so the window need not reach further back than that.
        outermost = np.maximum.accumulate(sel_end).searchsorted(c_end, side="left")
        lookback = int((hi - np.maximum(outermost, hi - min(_LOOKBACK, sel.size))).max())
        if lookback <= 0:  # no op encloses any of these calls
            continue
        # A window of those ops for each call, oldest first.
        win = hi[:, None] - lookback + np.arange(lookback)[None, :]
        pos = np.maximum(win, 0)  # positions before the first op are masked off just below
        enclosing = (win >= 0) & (sel_end[pos] >= c_end[:, None])
        known = enclosing & sel_trigger[pos]
        # The outermost known trigger is what the user wrote (aten::item, not its helper);
        # with none known, the innermost enclosing op.
        first_known = known.argmax(axis=1)
        last_enclosing = lookback - 1 - enclosing[:, ::-1].argmax(axis=1)
        rows = np.arange(c.size)
        pick = sel[np.where(known.any(axis=1), pos[rows, first_known], pos[rows, last_enclosing])]
        picked[mine] = np.where(enclosing.any(axis=1), pick, -1)
    count: dict[str, int] = defaultdict(int)
    blocked: dict[str, int] = defaultdict(int)
    names = h.name[picked].tolist()  # entries without an op (-1) are ignored just below
    for op_idx, name_id, dur in zip(picked.tolist(), names, h.dur[calls].tolist(), strict=True):
        name = trace.strings[name_id] if op_idx >= 0 else "(no enclosing op)"
        count[name] += 1
        blocked[name] += int(dur)
    out = [Trigger(op, count[op], blocked[op]) for op in count]
    return sorted(out, key=lambda t: -t.blocked_ns)[:10]
