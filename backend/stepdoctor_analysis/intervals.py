"""Interval algebra on sorted int64 arrays (ns): the one place unions and overlaps are computed.

An interval set is a pair ``(starts, ends)`` of equal-length int64 arrays. Functions named
``union`` return a normalised set: sorted, non-overlapping, non-empty intervals.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
Intervals = tuple[I64, I64]

EMPTY: Intervals = (np.empty(0, np.int64), np.empty(0, np.int64))


def union(starts: I64, ends: I64) -> Intervals:
    """Merge possibly overlapping intervals into a normalised set."""
    if starts.size == 0:
        return EMPTY
    order = np.argsort(starts, kind="stable")
    s = starts[order].astype(np.int64, copy=False)
    e = ends[order].astype(np.int64, copy=False)
    keep = e > s
    s, e = s[keep], e[keep]
    if s.size == 0:
        return EMPTY
    running_end = np.maximum.accumulate(e)
    # A new run starts where this start lies beyond every earlier end.
    new_run = np.empty(s.size, dtype=np.bool_)
    new_run[0] = True
    new_run[1:] = s[1:] > running_end[:-1]
    run_ids = np.cumsum(new_run) - 1
    out_s = s[new_run]
    out_e = np.zeros(out_s.size, dtype=np.int64)
    np.maximum.at(out_e, run_ids, e)
    return out_s, out_e


def total(iv: Intervals) -> int:
    """Total length of a normalised set."""
    return int((iv[1] - iv[0]).sum())


def clip(iv: Intervals, lo: int, hi: int) -> Intervals:
    """Restrict a normalised set to ``[lo, hi)``."""
    s = np.clip(iv[0], lo, hi)
    e = np.clip(iv[1], lo, hi)
    keep = e > s
    return s[keep], e[keep]


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Intersection of two normalised sets, in time linear in the output.

    Each interval of ``a`` overlaps a contiguous run of ``b``'s intervals (found by binary
    search); pairing them needs no sort, and the pieces come out sorted and disjoint.
    """
    if a[0].size == 0 or b[0].size == 0:
        return EMPTY
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


def complement(iv: Intervals) -> Intervals:
    """Everything not covered by a normalised set (bounded by the int64 range)."""
    lo, hi = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    s = np.concatenate([[lo], iv[1]]).astype(np.int64)
    e = np.concatenate([iv[0], [hi]]).astype(np.int64)
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
    # Prefix sums of covered length let each window be answered with two lookups.
    cum = np.concatenate([[0], np.cumsum(iv[1] - iv[0])])
    return _covered_before(iv, cum, win_ends) - _covered_before(iv, cum, win_starts)


def _covered_before(iv: Intervals, cum: I64, t: I64) -> I64:
    """Covered length of a normalised set in ``(-inf, t)`` for each t."""
    idx = np.searchsorted(iv[0], t, side="right") - 1
    out = np.zeros(t.size, dtype=np.int64)
    ok = idx >= 0
    j = idx[ok]
    out[ok] = cum[j] + np.minimum(t[ok], iv[1][j]) - iv[0][j]
    return out
