"""Array helpers the analyzers share."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct values of a 1-D array of ids or codes: ``np.unique``'s answer, by a sort.

    numpy 2's plain ``np.unique`` hashes, which measured 5-7x slower than sorting on 100k-400k ids,
    and first asks ``np.ma.is_masked``, whose first call imports numpy.ma (~11 ms of every
    ``stepdoctor analyze``). Floats keep ``np.unique``: its NaN handling is the one wanted there.
    """
    if values.dtype.kind not in "biu":
        return np.unique(values)
    ordered = np.sort(values)
    if ordered.size < 2:
        return ordered
    keep = np.empty(ordered.size, dtype=np.bool_)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def percentiles(values: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """``np.percentile(values, qs)`` of a 1-D array of integers (numpy's default linear method, the
    same floats), by a sort: numpy's own calls ``np.unique``, whose first call imports numpy.ma.
    Other arrays (floats: NaN handling) and empty ones go to ``np.percentile``."""
    if values.dtype.kind not in "biu" or values.size == 0:
        return np.percentile(values, qs)
    ordered = np.sort(values)
    n = ordered.size
    virtual = (n - 1) * np.true_divide(np.asarray(qs, dtype=np.float64), 100)
    before = np.floor(virtual).astype(np.intp)
    after = before + 1
    last = virtual >= n - 1
    before[last] = after[last] = -1
    gamma = virtual - before
    low, high = ordered[before], ordered[after]
    step = high - low
    out = np.add(low, step * gamma)
    np.subtract(high, step * (1 - gamma), out=out, where=gamma >= 0.5)  # numpy's lerp, both halves
    return out


def median_of(values: np.ndarray) -> float:
    """``np.median`` of a 1-D array, the same float: numpy's checks a float array for NaN through
    numpy.ma (imported on first use). Floats holding NaN go to ``np.median`` for its answer."""
    if values.dtype.kind == "f" and np.isnan(values).any():
        return float(np.median(values))
    n = values.size
    if n == 0:
        return float(np.median(values))  # numpy's NaN and warning
    half = n // 2
    part = np.partition(values, (half - 1, half) if n % 2 == 0 else half)
    return float(np.mean(part[half - 1 : half + 1] if n % 2 == 0 else part[half : half + 1]))
