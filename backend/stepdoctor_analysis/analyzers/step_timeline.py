"""A few representative steps, drawn as lanes: host threads, GPU streams, and what each stretch was charged to.

The dashboard draws one step from this without opening the trace, so pages stay fast whatever the
trace's size: the worker computes it once, next to the report. Pure: trace and analyzer results in,
a compact JSON-ready dict out.

- Steps: the median-duration step, the slowest, and the first when it is a warm-up outlier
  (over ``WARMUP_RATIO`` × the median), at most three.
- Lanes: the busiest ``MAX_THREADS`` host threads (their outermost ops, runtime calls and
  annotations other than the step marker), the busiest ``MAX_STREAMS`` GPU streams (kernels, copies,
  memsets), and a ``charged`` lane: the step partitioned into bottleneck kinds with exactly the
  layers and idle-charging rules of ``diagnose.account`` (compute / communication / transfer while
  the device is busy; input, memory, sync, launch, other for the stretches it idles).
- Size: each lane holds at most ``MAX_BOXES`` boxes; beyond that, neighbours closer than a growing
  gap merge into one box labelled by its longest member and counting how many it holds.

Box: ``[start_us, end_us, label, count]``, times relative to the step's start, ``label`` an index
into ``names`` (host and GPU lanes) or a bottleneck kind (the charged lane).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..model import intervals as iv
from ..model.arrays import median_of
from ..model.steps import step_marker_mask
from ..model.trace import GpuKind, HostKind, RankTrace, Step
from .timeline import Accounting

MAX_BOXES = 400
MAX_THREADS = 3
MAX_STREAMS = 6
MAX_STEPS = 3
WARMUP_RATIO = 1.5
_BUSY_KINDS = ("compute", "communication", "transfer")


def representative_steps(steps: list[Step]) -> list[tuple[Step, str]]:
    """(step, why it was chosen), in step order: median, slowest, and a warm-up outlier first step."""
    if not steps:
        return []
    durs = np.array([s.end - s.start for s in steps], dtype=np.int64)
    order = durs.argsort(kind="stable")
    chosen: dict[int, str] = {int(order[(len(order) - 1) // 2]): "median step"}
    chosen.setdefault(int(order[-1]), "slowest step")
    median = median_of(durs)
    if len(steps) > 2 and durs[0] > WARMUP_RATIO * median:
        chosen.setdefault(0, "first step (warm-up)")
    return [(steps[i], chosen[i]) for i in sorted(chosen)[:MAX_STEPS]]


def build_timeline(trace: RankTrace, steps: list[Step], acc: Accounting) -> dict[str, Any]:
    """Lanes of the representative steps (see the module docstring)."""
    names: dict[str, int] = {}
    out = []
    for step, why in representative_steps(steps):
        lanes = _host_lanes(trace, step, names) + _gpu_lanes(trace, step, names)
        lanes.append(_charged_lane(step, acc))
        out.append(
            {
                "number": step.number,
                "why": why,
                "duration_us": round((step.end - step.start) / 1e3, 3),
                "lanes": lanes,
            }
        )
    return {"steps": out, "names": list(names)}


def _charged_lane(step: Step, acc: Accounting) -> dict[str, Any]:
    """The step partitioned into kinds exactly as ``diagnose.account`` did: each layer's claim
    within the step, then what they left free: on a GPU, the charged idle stretches within it."""
    s, e, layer = acc.claimed.within(step.start, step.end)
    parts = [(kind, (s[layer == k], e[layer == k])) for k, kind in enumerate(acc.layer_kinds)]
    if acc.on_gpu:
        parts += [(kind, iv.clip(ivs, step.start, step.end)) for kind, ivs in acc.idle.items()]
    else:
        parts.append(("other", (s[layer < 0], e[layer < 0])))
    layers = len(acc.layer_kinds)  # the charged idle stretches follow the layers: idle whatever their kind
    idle = sum(iv.total(ivs) for i, (kind, ivs) in enumerate(parts) if i >= layers or kind not in _BUSY_KINDS)
    return {
        "label": "device time charged to" if acc.on_gpu else "step time charged to",
        "kind": "charged",
        "boxes": _charged_boxes(parts, step),
        "idle_us": _us(idle),
    }


def _charged_boxes(parts: list[tuple[str, iv.Intervals]], step: Step) -> list[list[Any]]:
    """The partition as boxes; adjacent stretches of one kind merge into one box.

    A step with more stretches than a figure can show is cut into ``2 × MAX_BOXES`` equal bins,
    each given to the kind owning most of it, so no time disappears from the picture.
    """
    if sum(ivs[0].size for _, ivs in parts) > 2 * MAX_BOXES:
        kinds, lo, hi, code = _dominant_bins(parts, step, 2 * MAX_BOXES)
    else:
        codes: dict[str, int] = {}
        of_part = [codes.setdefault(kind, len(codes)) for kind, _ in parts]
        kinds = list(codes)
        code = np.repeat(np.array(of_part, np.int64), [ivs[0].size for _, ivs in parts])
        starts = np.concatenate([ivs[0] for _, ivs in parts])
        ends = np.concatenate([ivs[1] for _, ivs in parts])
        order = starts.argsort(kind="stable")
        lo, hi, code = starts[order], ends[order], code[order]
        keep = hi > lo
        lo, hi, code = lo[keep], hi[keep], code[keep]
    if lo.size == 0:
        return []
    # A box starts where the kind changes or the previous stretch does not end where this one starts.
    first = np.ones(lo.size, np.bool_)
    first[1:] = (code[1:] != code[:-1]) | (lo[1:] != hi[:-1])
    firsts = first.nonzero()[0]
    bounds = np.append(firsts, lo.size)
    lo_us = _us_list(lo[firsts].astype(np.int64) - step.start)
    hi_us = _us_list(hi[bounds[1:] - 1].astype(np.int64) - step.start)
    return [
        [a, b, kinds[c], n]
        for a, b, c, n in zip(lo_us, hi_us, code[firsts].tolist(), np.diff(bounds).tolist(), strict=True)
    ]


def _dominant_bins(
    parts: list[tuple[str, iv.Intervals]], step: Step, bins: int
) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """(kinds, bin starts, bin ends, index into kinds of each bin's owner).

    The parts partition the step, so all their stretches together are one disjoint set: each
    kind's coverage up to every bin edge is read from one per-kind running sum over that set.
    """
    edges = np.linspace(step.start, step.end, bins + 1).astype(np.int64)
    names = sorted({kind for kind, _ in parts})
    code = np.repeat(
        np.array([names.index(kind) for kind, _ in parts], np.int64), [ivs[0].size for _, ivs in parts]
    )
    s = np.concatenate([ivs[0] for _, ivs in parts])
    e = np.concatenate([ivs[1] for _, ivs in parts])
    order = s.argsort(kind="stable")
    s, e, code = s[order], e[order], code[order]
    by_kind = np.zeros((s.size + 1, len(names)), np.int64)  # row j: coverage of the first j stretches
    by_kind[np.arange(1, s.size + 1), code] = e - s
    by_kind = by_kind.cumsum(axis=0)
    i = e.searchsorted(edges, side="right")  # stretches wholly before each edge
    covered = by_kind[i]
    inside = np.flatnonzero(i < s.size)
    covered[inside, code[i[inside]]] += np.clip(edges[inside] - s[i[inside]], 0, None)
    owned = np.diff(covered, axis=0).T
    return names, edges[:-1], edges[1:], owned.argmax(axis=0)


def _host_lanes(trace: RankTrace, step: Step, names: dict[str, int]) -> list[dict[str, Any]]:
    h = trace.host
    if not len(h):
        return []
    shown = trace.memo("step_timeline.host_shown", lambda: _host_shown(trace))
    sel = _by_start_longest_first(_overlapping(shown, h.ts, h.end, step), h.ts, h.dur)
    pids, tids = h.pid[sel], h.tid[sel]
    one_process = bool(pids.size) and bool((pids == pids[0]).all())
    lanes = []
    for pid, tid in _busiest(pids, tids, h.dur[sel], MAX_THREADS):
        idx = sel[(pids == pid) & (tids == tid)]
        # Outermost events only: one that starts after every earlier one ended.
        latest = np.maximum.accumulate(h.end[idx])
        top = np.ones(idx.size, np.bool_)
        top[1:] = h.ts[idx][1:] >= latest[:-1]
        idx = idx[top]
        label = f"host thread {tid}" if one_process else f"host {pid}/{tid}"
        lanes.append(_lane(trace, label, "host", h.ts[idx], h.end[idx], h.name[idx], step, names))
    return lanes


def _host_shown(trace: RankTrace) -> np.ndarray:
    """Host events a lane draws: ops, annotations other than the step marker, runtime calls."""
    shown = trace.host_kind(HostKind.CPU_OP, HostKind.USER_ANNOTATION, HostKind.RUNTIME, HostKind.DRIVER)
    return np.asarray(shown & ~step_marker_mask(trace))


def _by_start_longest_first(idx: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """``idx`` ordered by start, longest first among equal starts, then by index: the order
    nesting needs. A stable sort of nearly sorted starts is cheap; only the tied few are lexsorted."""
    idx = idx[ts[idx].argsort(kind="stable")]
    at = ts[idx]
    tied = np.zeros(idx.size, np.bool_)
    tied[1:] = at[1:] == at[:-1]
    tied[:-1] |= tied[1:]
    if tied.any():
        pos = tied.nonzero()[0]
        idx[pos] = idx[pos][np.lexsort((-dur[idx[pos]], at[pos]))]
    return idx


def _overlapping(shown: np.ndarray, ts: np.ndarray, end: np.ndarray, step: Step) -> np.ndarray:
    """Indices of the shown events overlapping the step, in index order.

    Three passes over the table per drawn step (at most ``MAX_STEPS``) instead of sorting every
    event once: only the few drawn steps' events need an order.
    """
    return (shown & (ts < step.end) & (end > step.start)).nonzero()[0]


def _gpu_lanes(trace: RankTrace, step: Step, names: dict[str, int]) -> list[dict[str, Any]]:
    g = trace.gpu
    if not len(g):
        return []
    shown = trace.gpu_kind(GpuKind.KERNEL, GpuKind.MEMCPY, GpuKind.MEMSET)
    sel = _overlapping(shown, g.ts, g.end, step)
    sel = sel[g.ts[sel].argsort(kind="stable")]  # by start, then index
    devices, streams = g.device[sel], g.stream[sel]
    lanes = []
    for device, stream in _busiest(devices.astype(np.int64), streams, g.dur[sel], MAX_STREAMS):
        idx = sel[(devices == device) & (streams == stream)]
        label = f"GPU {device} stream {stream}"
        lanes.append(_lane(trace, label, "gpu", g.ts[idx], g.end[idx], g.name[idx], step, names))
    return lanes


def _busiest(a: np.ndarray, b: np.ndarray, dur: np.ndarray, k: int) -> list[tuple[int, int]]:
    """The ``k`` (a, b) pairs with the most summed duration (ties: lower pair first), in (a, b) order.

    A step's events come from a handful of threads or streams: peeling off one pair at a time
    costs a few passes over the step's events, where a sort-based ``unique`` costs far more. Past
    ``_PEEL_MAX`` pairs, ``_busiest_sorted`` takes over.
    """
    busy: dict[tuple[int, int], int] = {}
    rest = np.arange(a.size)
    while rest.size and len(busy) < _PEEL_MAX:
        pa, pb = a[rest], b[rest]
        same = (pa == pa[0]) & (pb == pb[0])
        busy[(int(pa[0]), int(pb[0]))] = int(dur[rest[same]].sum())
        rest = rest[~same]
    if rest.size:
        return _busiest_sorted(a, b, dur, k)
    ranked = sorted(sorted(busy), key=lambda pair: -busy[pair])  # stable: ties stay in (a, b) order
    return sorted(ranked[:k])


_PEEL_MAX = 16


def _busiest_sorted(a: np.ndarray, b: np.ndarray, dur: np.ndarray, k: int) -> list[tuple[int, int]]:
    """``_busiest`` for many pairs: two 1-D ``unique`` calls and a ``bincount`` (a row-wise
    ``unique(axis=0)`` sorts structured rows and cost most of the timeline on large traces)."""
    a_vals, a_code = np.unique(a, return_inverse=True)
    b_vals, b_code = np.unique(b, return_inverse=True)
    code = a_code.astype(np.int64) * b_vals.size + b_code
    present = np.bincount(code).nonzero()[0]  # pairs that occur (not every a meets every b)
    busy = np.bincount(code, weights=dur.astype(np.float64))[present]
    top = sorted(present[(-busy).argsort(kind="stable")[:k]].tolist())
    return [(int(a_vals[c // b_vals.size]), int(b_vals[c % b_vals.size])) for c in top]


def _lane(
    trace: RankTrace,
    label: str,
    kind: str,
    starts: np.ndarray,
    ends: np.ndarray,
    name_ids: np.ndarray,
    step: Step,
    names: dict[str, int],
) -> dict[str, Any]:
    # ndarray methods, not the np.* wrappers: a drawn step holds many small lanes, where the
    # wrappers' Python-level dispatch costs more than the arithmetic.
    s = starts.clip(step.start, step.end) - step.start
    e = ends.clip(step.start, step.end) - step.start
    label_ids, counts = name_ids, np.ones(s.size, np.int64)
    merged = 0
    gap = max(1, (step.end - step.start) // (MAX_BOXES * 8))
    while s.size > MAX_BOXES:
        s, e, label_ids, counts = _merge_close(s, e, e - s, label_ids, counts, gap)
        merged = 1
        gap *= 2
    ids = label_ids.tolist()
    ref = {i: names.setdefault(trace.strings[i], len(names)) for i in dict.fromkeys(ids)}  # first-seen order
    boxes = [
        [a, b, ref[i], n] for a, b, i, n in zip(_us_list(s), _us_list(e), ids, counts.tolist(), strict=True)
    ]
    return {"label": label, "kind": kind, "boxes": boxes, "merged": bool(merged)}


def _merge_close(
    s: np.ndarray, e: np.ndarray, d: np.ndarray, labels: np.ndarray, counts: np.ndarray, gap: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Merge boxes separated by less than ``gap`` ns; a group keeps its longest member's label."""
    reach = np.maximum.accumulate(e)
    new = np.ones(s.size, np.bool_)
    new[1:] = s[1:] - reach[:-1] >= gap
    group = np.cumsum(new) - 1
    firsts = new.nonzero()[0]
    g_start = s[firsts]
    g_end = np.maximum.reduceat(e, firsts)
    # Each group's label: its first member of the group's greatest duration (groups are runs).
    longest = (d == np.maximum.reduceat(d, firsts)[group]).nonzero()[0]
    first_of_group = np.ones(longest.size, np.bool_)
    first_of_group[1:] = group[longest][1:] != group[longest][:-1]
    g_label = labels[longest[first_of_group]]
    g_count = np.add.reduceat(counts, firsts)
    return g_start, g_end, g_label, g_count


def _us(ns: int) -> float:
    return round(int(ns) / 1e3, 3)


def _us_list(ns: np.ndarray) -> list[float]:
    """ns → µs rounded to the ns, for a whole array at once (``round`` per numpy scalar is slow)."""
    out: list[float] = (ns / 1e3).round(3).tolist()
    return out
