"""Interval algebra against a brute-force oracle: coverage as a boolean array over small integers."""

from __future__ import annotations

import numpy as np
import pytest

from stepdoctor_analysis.model import intervals as iv

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


def _random_windows(rng: np.random.Generator, overlapping: bool) -> tuple[np.ndarray, np.ndarray]:
    n = int(rng.integers(1, 6))
    if overlapping:
        s = np.sort(rng.integers(0, SPAN, n)).astype(np.int64)
        return s, s + rng.integers(0, 50, n)
    edges = np.sort(rng.choice(SPAN, 2 * n, replace=False)).astype(np.int64)
    return edges[0::2], edges[1::2]


@pytest.mark.parametrize("seed", range(60))
def test_claim_in_order_matches_claiming_one_layer_at_a_time(seed: int) -> None:
    """Each layer gets, per window, what it covers there that no earlier layer covers."""
    rng = np.random.default_rng(seed)
    ws, we = _random_windows(rng, overlapping=seed % 2 == 1)
    raw = [_random_set(rng) for _ in range(int(rng.integers(0, 5)))]
    if seed % 5 == 0 and raw:
        raw[0] = (np.empty(0, np.int64), np.empty(0, np.int64))  # an empty layer claims nothing
    got = iv.claim_in_order(ws, we, [iv.union(s, e) for s, e in raw])
    taken = np.zeros(SPAN + 40, dtype=bool)
    for k, (s, e) in enumerate(raw):
        mine = _cover(s, e) & ~taken
        taken |= mine
        assert got.per_layer[k].tolist() == [int(mine[a:b].sum()) for a, b in zip(ws, we, strict=True)]
    assert got.unclaimed.tolist() == [int((~taken)[a:b].sum()) for a, b in zip(ws, we, strict=True)]
    assert np.array_equal(_cover(*got.free), _cover(ws, we) & ~taken)


@pytest.mark.parametrize("seed", range(40))
def test_claimed_within_reads_each_windows_partition_from_the_sweep(seed: int) -> None:
    """What a drawn step reads back: per layer, the normalised set it claimed inside the window;
    the rest of the window is free (the step timeline's charged lane relies on this)."""
    rng = np.random.default_rng(seed)
    ws, we = _random_windows(rng, overlapping=seed % 2 == 1)
    raw = [_random_set(rng) for _ in range(int(rng.integers(1, 5)))]
    layers = [iv.union(s, e) for s, e in raw]
    got = iv.claim_in_order(ws, we, layers)
    for a, b in zip(ws.tolist(), we.tolist(), strict=True):
        if b <= a:
            continue
        s, e, layer = got.within(a, b)
        assert np.all(e > s) and np.all(s[1:] >= e[:-1])  # in time order, no overlap, nothing empty
        free: iv.Intervals = (np.array([a], np.int64), np.array([b], np.int64))
        for k, claim in enumerate(layers):  # the sequential claim the sweep stands for
            owned = iv.intersect(free, iv.clip(claim, a, b))
            free = iv.subtract(free, owned)
            mine = (s[layer == k], e[layer == k])
            assert mine[0].tolist() == owned[0].tolist() and mine[1].tolist() == owned[1].tolist()
        assert _cover(s[layer == -1], e[layer == -1]).tolist() == _cover(*free).tolist()
        assert not (layer == -2).any()  # inside a window: never "outside every window"


def test_union_of_negative_times() -> None:
    s, e = iv.union(np.array([-50, -40, -10]), np.array([-30, -35, -5]))
    assert s.tolist() == [-50, -10] and e.tolist() == [-30, -5]


@pytest.mark.parametrize("seed", range(30))
def test_mean_or_zero_equals_numpys_mean(seed: int) -> None:
    """The engine's one remaining stand-in returns exactly what numpy returns."""
    from stepdoctor_analysis.analyzers import timeline as tl

    rng = np.random.default_rng(seed)
    a = rng.integers(0, 10 ** int(rng.integers(1, 12)), int(rng.integers(1, 40))).astype(np.int64)
    assert tl.mean_or_zero(a) == float(a.mean())
    assert tl.mean_or_zero(a / 7.0) == float((a / 7.0).mean())
    assert tl.mean_or_zero(a[:0]) == 0.0
