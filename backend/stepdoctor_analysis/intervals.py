"""Interval algebra on sorted int64 arrays (ns): the one place unions and overlaps are computed.

An interval set is a pair ``(starts, ends)`` of equal-length int64 arrays. Functions named
``union`` return a normalised set: sorted, non-overlapping, non-empty intervals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
Intervals = tuple[I64, I64]

EMPTY: Intervals = (np.empty(0, np.int64), np.empty(0, np.int64))
EMPTY[0].flags.writeable = EMPTY[1].flags.writeable = False  # shared by every empty result


def union(starts: I64, ends: I64) -> Intervals:
    """Merge possibly overlapping intervals into a normalised set."""
    keep = ends > starts
    s, e = starts[keep].astype(np.int64, copy=False), ends[keep].astype(np.int64, copy=False)
    if s.size <= 1:
        return (s, e) if s.size else EMPTY
    if not (s[1:] >= s[:-1]).all():  # events come sorted by start: usually nothing to do
        order = np.argsort(s, kind="stable")
        s, e = s[order], e[order]
    running_end = np.maximum.accumulate(e)
    # A new run starts after each position i where the next start lies beyond every earlier end.
    # A run's end is the running maximum at its last member: every earlier run ended before it began.
    breaks = np.flatnonzero(s[1:] > running_end[:-1])
    return np.concatenate((s[:1], s[breaks + 1])), np.concatenate((running_end[breaks], running_end[-1:]))


def total(iv: Intervals) -> int:
    """Total length of a normalised set."""
    return int((iv[1] - iv[0]).sum())


def clip(iv: Intervals, lo: int, hi: int) -> Intervals:
    """Restrict a normalised set to ``[lo, hi)``."""
    return _within(iv, lo, hi) if hi > lo and iv[0].size else EMPTY


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Intersection of two normalised sets, in time linear in the output.

    Each interval of ``a`` overlaps a contiguous run of ``b``'s intervals (found by binary
    search); pairing them needs no sort, and the pieces come out sorted and disjoint.
    """
    if a[0].size == 0 or b[0].size == 0:
        return EMPTY
    if a[0].size == 1:  # one step window: a slice of the other set (a fraction of the general cost)
        return _within(b, int(a[0][0]), int(a[1][0]))
    if b[0].size == 1:
        return _within(a, int(b[0][0]), int(b[1][0]))
    first = np.searchsorted(b[1], a[0], side="right")  # first b ending after a starts
    stop = np.searchsorted(b[0], a[1], side="left")  # first b starting at or after a ends
    counts = np.maximum(stop - first, 0)
    n = int(counts.sum())
    if n == 0:
        return EMPTY
    ai = np.repeat(np.arange(counts.size), counts)
    group_start = np.cumsum(counts) - counts
    bj = first[ai] + (np.arange(n) - group_start[ai])
    s = np.maximum(a[0][ai], b[0][bj])
    e = np.minimum(a[1][ai], b[1][bj])
    keep = e > s
    return s[keep], e[keep]


_LOWEST = np.array([np.iinfo(np.int64).min], np.int64)
_HIGHEST = np.array([np.iinfo(np.int64).max], np.int64)


def _within(iv: Intervals, lo: int, hi: int) -> Intervals:
    """A normalised set's intersection with one non-empty interval ``[lo, hi)``."""
    first = int(iv[1].searchsorted(lo, side="right"))  # first interval ending after lo
    stop = int(iv[0].searchsorted(hi, side="left"))  # first interval starting at or after hi
    if first >= stop:
        return EMPTY
    s, e = iv[0][first:stop].copy(), iv[1][first:stop].copy()
    s[0] = max(int(s[0]), lo)
    e[-1] = min(int(e[-1]), hi)
    return s, e


def complement(iv: Intervals) -> Intervals:
    """Everything not covered by a normalised set (bounded by the int64 range)."""
    s = np.concatenate((_LOWEST, iv[1]))
    e = np.concatenate((iv[0], _HIGHEST))
    keep = e > s
    return s[keep], e[keep]


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """Parts of normalised set ``a`` not covered by normalised set ``b``."""
    if a[0].size == 0:
        return EMPTY
    if b[0].size == 0:
        return a
    return intersect(a, complement(b))


def overlap_total(a: Intervals, b: Intervals) -> int:
    """Length of the intersection of two normalised sets."""
    return total(intersect(a, b))


def per_window_total(iv: Intervals, win_starts: I64, win_ends: I64) -> I64:
    """Covered length of a normalised set inside each window (windows may overlap each other)."""
    if iv[0].size == 0 or win_starts.size == 0:
        return np.zeros(win_starts.size, dtype=np.int64)
    if win_starts.size == 1 and win_ends[0] > win_starts[0]:  # one step: a slice, a fraction of the cost
        return np.array([total(_within(iv, int(win_starts[0]), int(win_ends[0])))], dtype=np.int64)
    s, e = iv
    # Covered length before t: the intervals starting at or before t (a prefix sum), less the
    # part of the last of them that runs past t. All window edges are answered in one search.
    t = np.concatenate((win_starts, win_ends))
    k = np.searchsorted(s, t, side="right")
    full = np.concatenate(([0], np.cumsum(e - s)))[k]
    past_t = np.where(k > 0, np.maximum(e[k - 1] - t, 0), 0)
    before = full - past_t
    n = win_starts.size
    return before[n:] - before[:n]


@dataclass(frozen=True)
class Claimed:
    """What :func:`claim_in_order` hands out: ns per window for each layer, and what is left."""

    per_layer: list[I64]  # aligned with the layers; each array aligned with the windows
    unclaimed: I64  # ns of each window no layer claimed
    free: Intervals  # the windows' unclaimed time, as a normalised set


def claim_in_order(win_starts: I64, win_ends: I64, layers: Sequence[Intervals]) -> Claimed:
    """Hand out the windows' time to normalised sets in priority order; nothing is counted twice.

    Layer k claims the part of the windows that it covers and no earlier layer covers. One sweep
    over every boundary, sorted once, answers all layers (claiming them one at a time costs a union
    or an intersection over everything claimed so far, per layer). Between consecutive boundaries
    the coverage is a bitmask: bit 0 "outside every window", bit k + 1 layer k; the stretch belongs
    to its lowest set bit, or is free when none is set. Per-window totals are differences of
    prefix sums read at the window edges (boundaries that change nothing), so windows may overlap.
    The arithmetic is int64 throughout: the totals are exact.
    """
    n = win_starts.size
    nonempty = [k for k, layer in enumerate(layers) if layer[0].size]
    if len(nonempty) < len(layers):  # an empty layer claims nothing: sweep the others
        inner = claim_in_order(win_starts, win_ends, [layers[k] for k in nonempty])
        per_layer = [np.zeros(n, dtype=np.int64) for _ in layers]
        for k, per in zip(nonempty, inner.per_layer, strict=True):
            per_layer[k] = per
        return Claimed(per_layer, inner.unclaimed, inner.free)
    n_layers = len(layers)
    if n_layers > 61:
        raise ValueError("at most 61 layers fit the int64 bitmask")
    windows = union(win_starts, win_ends)
    sets = [windows, *layers, (win_starts, win_ends)]
    bits = [-1, *(2 << k for k in range(n_layers)), 0]  # windows clear bit 0; their edges change nothing
    sizes = [s.size for s, _ in sets]
    t = np.concatenate([s for s, _ in sets] + [e for _, e in sets]).astype(np.int64, copy=False)
    change = np.repeat(np.array(bits + [-b for b in bits], dtype=np.int64), sizes + sizes)
    order = t.argsort(kind="stable")
    t = t[order]
    # Stretch j = [t[j], t[j+1]) has the mask reached after boundary j. Where several boundaries
    # share a time, the stretches between them are empty: their partial masks weigh nothing.
    mask = change[order].cumsum()[:-1] + 1
    length = t[1:] - t[:-1]
    # Index of the lowest set bit: the exponent of that power of two (exact in float64).
    owner = np.frexp((mask & -mask).astype(np.float64))[1] - 1
    free_code = n_layers + 1
    owner[owner < 0] = free_code  # no bit set

    width = n_layers + 2
    if n == 1:  # one window: every owned stretch lies in it
        totals = np.zeros((width, 1), dtype=np.int64)
        np.add.at(totals[:, 0], owner, length)
    else:
        totals = _per_window_by_owner(t, owner, length, win_starts, win_ends, width)
    gaps = np.flatnonzero((owner == free_code) & (length > 0))
    free = union(t[gaps], t[gaps + 1]) if gaps.size else EMPTY
    return Claimed([totals[k + 1] for k in range(n_layers)], totals[free_code], free)


def _per_window_by_owner(
    t: I64, owner: npt.NDArray[np.int32], length: I64, win_starts: I64, win_ends: I64, width: int
) -> npt.NDArray[np.int64]:
    """Each owner's total length in each window (rows: owners, columns: windows).

    Sums the stretches between consecutive window edges by owner, accumulates over those blocks,
    and reads the accumulation at each window's two edges.
    """
    at = t.searchsorted(np.concatenate((win_starts, win_ends)), side="left")
    cuts = np.unique(at)
    block = np.zeros(t.size, dtype=np.int64)
    block[cuts] = 1
    block = block.cumsum()[:-1]
    sums = np.zeros((cuts.size + 1) * width, dtype=np.int64)
    np.add.at(sums, block * width + owner, length)
    before = np.zeros((cuts.size + 2, width), dtype=np.int64)
    before[1:] = sums.reshape(-1, width).cumsum(axis=0)
    at_edge = before[cuts.searchsorted(at) + 1]
    n = win_starts.size
    return (at_edge[n:] - at_edge[:n]).T
