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
    """Intersection of two normalised sets."""
    if a[0].size == 0 or b[0].size == 0:
        return EMPTY
    # Every boundary of either set; a point is covered by both when both coverage counts are 1.
    points = np.unique(np.concatenate([a[0], a[1], b[0], b[1]]))
    lo, hi = points[:-1], points[1:]
    in_a = _covered(a, lo)
    in_b = _covered(b, lo)
    both = in_a & in_b
    return union(lo[both], hi[both])


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """Parts of normalised set ``a`` not covered by normalised set ``b``."""
    if a[0].size == 0:
        return EMPTY
    if b[0].size == 0:
        return a
    points = np.unique(np.concatenate([a[0], a[1], b[0], b[1]]))
    lo, hi = points[:-1], points[1:]
    keep = _covered(a, lo) & ~_covered(b, lo)
    return union(lo[keep], hi[keep])


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


def _covered(iv: Intervals, points: I64) -> npt.NDArray[np.bool_]:
    """Whether each point lies in ``[start, end)`` of some interval of a normalised set."""
    idx = np.searchsorted(iv[0], points, side="right") - 1
    ok = idx >= 0
    res = np.zeros(points.size, dtype=np.bool_)
    res[ok] = points[ok] < iv[1][idx[ok]]
    return res


def _covered_before(iv: Intervals, cum: I64, t: I64) -> I64:
    """Covered length of a normalised set in ``(-inf, t)`` for each t."""
    idx = np.searchsorted(iv[0], t, side="right") - 1
    out = np.zeros(t.size, dtype=np.int64)
    ok = idx >= 0
    j = idx[ok]
    out[ok] = cum[j] + np.minimum(t[ok], iv[1][j]) - iv[0][j]
    return out
