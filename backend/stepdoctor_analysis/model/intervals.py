"""Interval algebra on sorted int64 arrays (ns): the one place unions and overlaps are computed.

An interval set is a pair ``(starts, ends)`` of equal-length int64 arrays. Functions named
``union`` return a normalised set: sorted, non-overlapping, non-empty intervals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .arrays import distinct

I64 = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]
Intervals = tuple[I64, I64]

EMPTY: Intervals = (np.empty(0, np.int64), np.empty(0, np.int64))
EMPTY[0].flags.writeable = EMPTY[1].flags.writeable = False  # shared by every empty result


def union(starts: I64, ends: I64) -> Intervals:
    """Merge possibly overlapping intervals into a normalised set."""
    keep = ends > starts
    s, e = starts[keep].astype(np.int64, copy=False), ends[keep].astype(np.int64, copy=False)
    if s.size <= 1:
        return (s, e) if s.size else EMPTY
    if (s[1:] < s[:-1]).any():  # events come sorted by start: usually nothing to do
        order = s.argsort(kind="stable")
        s, e = s[order], e[order]
    running_end = np.maximum.accumulate(e)
    # A new run starts after each position i where the next start lies beyond every earlier end.
    # A run's end is the running maximum at its last member: every earlier run ended before it began.
    breaks = (s[1:] > running_end[:-1]).nonzero()[0]
    return np.concatenate((s[:1], s[breaks + 1])), np.concatenate((running_end[breaks], running_end[-1:]))


def member(values: I64, pool: I64) -> Mask:
    """``np.isin(values, pool)`` by binary search in the sorted pool: several times faster on
    millions of ids (no hashing), and without ``np.isin``'s fixed cost on a few."""
    if pool.size == 0:
        return np.zeros(values.size, np.bool_)
    pool = np.sort(pool, kind="stable")  # ids mostly arrive in order: a run-aware sort is ~50x faster
    idx = np.minimum(pool.searchsorted(values), pool.size - 1)
    return pool[idx] == values


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
    first = b[1].searchsorted(a[0], side="right")  # first b ending after a starts
    stop = b[0].searchsorted(a[1], side="left")  # first b starting at or after a ends
    counts = np.maximum(stop - first, 0)
    n = int(counts.sum())
    if n == 0:
        return EMPTY
    ai = np.arange(counts.size).repeat(counts)
    group_start = counts.cumsum() - counts
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
    if win_starts.size == 1:  # one step: each interval's part inside it, summed (a fraction of the cost)
        inside = np.minimum(iv[1], win_ends[0]) - np.maximum(iv[0], win_starts[0])
        return np.maximum(inside, 0).sum(keepdims=True)
    s, e = iv
    # Covered length before t: the intervals starting at or before t (a prefix sum), less the
    # part of the last of them that runs past t. All window edges are answered in one search.
    t = np.concatenate((win_starts, win_ends))
    k = s.searchsorted(t, side="right")
    full = np.concatenate(([0], (e - s).cumsum()))[k]
    past_t = np.where(k > 0, np.maximum(e[k - 1] - t, 0), 0)
    before = full - past_t
    n = win_starts.size
    return before[n:] - before[:n]


@dataclass(frozen=True)
class Claimed:
    """What :func:`claim_in_order` hands out: ns per window for each layer, and what is left."""

    per_layer: list[I64]  # aligned with the layers; each array aligned with the windows
    unclaimed: I64  # ns of each window no layer claimed
    _bounds: I64 = field(repr=False)  # the sweep's sorted boundaries ...
    _free: Mask = field(repr=False)  # ... and whether the stretch after each one is free
    _owner: npt.NDArray[np.int32] = field(repr=False)  # ... and its owner: layer + 1, 0 outside

    @property
    def free(self) -> Intervals:
        """The windows' unclaimed time, as a normalised set (only the diagnosis asks for it)."""
        at = self._free.nonzero()[0]
        return union(self._bounds[at], self._bounds[at + 1])

    def within(self, lo: int, hi: int) -> tuple[I64, I64, I64]:
        """The stretches of ``[lo, hi)`` as (starts, ends, layer; -1: free, -2: outside every window),
        in time order, touching stretches of one layer merged: per layer, exactly the part of
        ``[lo, hi)`` it claimed, as a normalised set (a drawn step reads it without a new sweep)."""
        t = self._bounds
        j0 = max(int(t.searchsorted(lo, side="right")) - 1, 0)
        j1 = int(t.searchsorted(hi, side="left"))
        s = np.maximum(t[j0:j1], lo)
        e = np.minimum(t[j0 + 1 : j1 + 1], hi)
        owner = self._owner[j0:j1].astype(np.int64)
        layer = np.where(self._free[j0:j1], -1, np.where(owner == 0, -2, owner - 1))
        keep = e > s
        s, e, layer = s[keep], e[keep], layer[keep]
        first = np.ones(s.size, np.bool_)
        first[1:] = (layer[1:] != layer[:-1]) | (s[1:] != e[:-1])
        starts = first.nonzero()[0]
        last = np.append(starts[1:], s.size) - 1
        return s[starts], e[last], layer[starts]


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
    n_layers = len(layers)
    if n_layers > 61:
        raise ValueError("at most 61 layers fit the int64 bitmask")
    sets = [union(win_starts, win_ends)]
    bits = [-1]  # windows clear bit 0
    for k, layer in enumerate(layers):
        if layer[0].size:  # an empty layer claims nothing: it needs no place in the sweep
            sets.append(layer)
            bits.append(2 << k)
    if n > 1:  # window edges change nothing, but split the sweep where per-window sums are read
        sets.append((win_starts, win_ends))
        bits.append(0)
    sizes = [s.size for s, _ in sets]
    t = np.concatenate([s for s, _ in sets] + [e for _, e in sets])
    change = np.array(bits + [-b for b in bits], dtype=np.int64).repeat(sizes + sizes)
    order = t.argsort(kind="stable")
    t = t[order]
    # Stretch j = [t[j], t[j+1]) has the mask reached after boundary j. Where several boundaries
    # share a time, the stretches between them are empty: their partial masks weigh nothing.
    mask = change[order].cumsum()[:-1] + 1
    length = t[1:] - t[:-1]
    # Index of the lowest set bit: the exponent of that power of two (exact in float64); a stretch
    # with no bit set (exponent 0) is free.
    free_code = n_layers + 1
    owner = np.frexp((mask & -mask).astype(np.float64))[1] - 1
    is_free = owner < 0
    owner[is_free] = free_code

    width = n_layers + 2
    if n == 1:  # one window: every owned stretch lies in it
        totals = np.zeros((width, 1), dtype=np.int64)
        np.add.at(totals[:, 0], owner, length)
    else:
        totals = _per_window_by_owner(t, owner, length, win_starts, win_ends, width)
    return Claimed([totals[k + 1] for k in range(n_layers)], totals[free_code], t, is_free, owner)


def _per_window_by_owner(
    t: I64, owner: npt.NDArray[np.int32], length: I64, win_starts: I64, win_ends: I64, width: int
) -> npt.NDArray[np.int64]:
    """Each owner's total length in each window (rows: owners, columns: windows).

    Sums the stretches between consecutive window edges by owner, accumulates over those blocks,
    and reads the accumulation at each window's two edges.
    """
    at = t.searchsorted(np.concatenate((win_starts, win_ends)), side="left")
    cuts = distinct(at)
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
