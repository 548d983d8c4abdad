"""Interval algebra against a brute-force oracle: coverage as a boolean array over small integers."""

from __future__ import annotations

import numpy as np
import pytest

from stepdoctor_analysis import intervals as iv

SPAN = 120


def _cover(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    mask = np.zeros(SPAN + 40, dtype=bool)
    for s, e in zip(starts, ends, strict=True):
        if e > s:
            mask[s:e] = True
    return mask


def _random_set(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n = int(rng.integers(0, 25))
    s = rng.integers(0, SPAN, n).astype(np.int64)
    return s, s + rng.integers(-3, 30, n)


@pytest.mark.parametrize("seed", range(40))
def test_operations_match_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    (s1, e1), (s2, e2) = _random_set(rng), _random_set(rng)
    a, b = iv.union(s1, e1), iv.union(s2, e2)
    ca, cb = _cover(s1, e1), _cover(s2, e2)
    assert np.array_equal(_cover(*a), ca)
    assert np.all(a[0][1:] > a[1][:-1]), "union must be sorted with gaps between intervals"
    assert iv.total(a) == ca.sum()
    assert np.array_equal(_cover(*iv.intersect(a, b)), ca & cb)
    assert np.array_equal(_cover(*iv.subtract(a, b)), ca & ~cb)
    assert iv.overlap_total(a, b) == (ca & cb).sum()
    lo, hi = sorted(int(x) for x in rng.integers(0, SPAN, 2))
    window = np.zeros_like(ca)
    window[lo:hi] = True
    assert np.array_equal(_cover(*iv.clip(a, lo, hi)), ca & window)
    assert iv.per_window_total(a, np.array([lo]), np.array([hi]))[0] == (ca & window).sum()


def test_empty_sets() -> None:
    a = iv.union(np.array([5]), np.array([9]))
    assert iv.total(iv.intersect(a, iv.EMPTY)) == 0
    assert iv.total(iv.subtract(a, iv.EMPTY)) == 4
    assert iv.total(iv.subtract(iv.EMPTY, a)) == 0
