"""Stated gains against gains that really happened: the real CUDA traces (tests/fixtures/traces/cuda/,
H100) and the step times ``cases.json`` measured without the profiler before and after each fix.

A recommendation's gain is what its change removes, bounded by what still has to run after it
(``floors``): removing ``.item()`` syncs gains nothing when the host is the slower side, overlapping
copies cannot hide the copy engine's own time, pinned copies gain by bandwidth and overlap, and
cheaper precision gains by the device's peak ratio. The verdict's "up to" is the first card's.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from stepdoctor_analysis.pipeline import analyze_path
from support.fixtures import TRACES

CUDA = TRACES / "cuda"
CASES: dict[str, dict[str, Any]] = json.loads((CUDA / "cases.json").read_text())["cases"]
MEASURED = {n: c["before_ms"] / c["after_ms"] for n, c in CASES.items() if "after_ms" in c}
# How far a stated gain may sit from the measured one: a profiled step is slower than the loop
# timed without the profiler, and a range is an estimate.
BELOW, ABOVE = 1.3, 1.1


@functools.cache
def _report(name: str) -> dict[str, Any]:
    return analyze_path(CUDA / name).to_dict()


def _span(rec: dict[str, Any]) -> tuple[float, float]:
    rng = rec.get("expected_speedup_range")
    return (rng[0], rng[1]) if rng else (rec["expected_speedup"], rec["expected_speedup"])


def _first(name: str) -> dict[str, Any]:
    recs = _report(f"{name}.json.gz")["recommendations"]
    assert recs, name
    return recs[0]


@pytest.mark.parametrize(
    ("name", "kind", "first", "forbidden"),
    [
        ("sync", "sync", "sync.host_sync", ()),
        ("sync_hostbound", "launch", "launch.cuda_graphs", ()),
        ("transfer", "transfer", "transfer.pinned_memory", ("transfer.overlap_copies",)),
        ("memory", "memory", "memory.allocator_steady_state", ()),
        ("compute_fp32", "compute", "compute.mixed_precision", ("compute.no_cheap_win",)),
        ("input", "input", "input.dataloader_workers", ()),
        ("launch", "launch", "launch.cuda_graphs", ()),
    ],
)
def test_verdict_first_card_and_forbidden_cards(
    name: str, kind: str, first: str, forbidden: tuple[str, ...]
) -> None:
    d = _report(f"{name}.json.gz")
    assert d["primary"]["kind"] == kind, (name, d["primary"])
    assert d["recommendations"][0]["id"] == first
    assert not {r["id"] for r in d["recommendations"]} & set(forbidden)


@pytest.mark.parametrize("name", sorted(n for n in MEASURED if MEASURED[n] >= 1.3 and n != "launch"))
def test_first_card_gain_is_near_the_measured_gain(name: str) -> None:
    """The fix that was measured is the first card; its stated gain (or range) holds the measured one,
    give or take the profiler's slowdown."""
    lo, hi = _span(_first(name))
    assert lo / BELOW <= MEASURED[name] <= hi * ABOVE, (name, lo, hi, MEASURED[name])


def test_launch_gain_is_an_upper_bound_of_the_measured_one() -> None:
    """CUDA graphs measured 9.7×; the profiled step's launch waits are longer than the real loop's
    (the profiler records every launch), so the stated gain only bounds it from above."""
    _lo, hi = _span(_first("launch"))
    assert MEASURED["launch"] <= hi * ABOVE


@pytest.mark.parametrize("name", sorted(n for n in MEASURED if MEASURED[n] < 1.1))
def test_no_gain_claimed_where_the_fix_gained_nothing(name: str) -> None:
    """sync_hostbound: dropping the reads measured no gain (the host is the slower side): the sync
    card may remain (the host still waits ~1 ms a step in them) but claims next to nothing, and
    the verdict is not sync."""
    d = _report(f"{name}.json.gz")
    sync = [r for r in d["findings"] if r["kind"] == "sync"]
    for r in sync:
        assert _span(r)[1] <= 1.1, r
    assert d["primary"]["kind"] != "sync"


@pytest.mark.parametrize("name", sorted(p.name for p in CUDA.glob("*.json.gz")))
def test_verdict_states_the_first_cards_gain(name: str) -> None:
    """The verdict's "removing it gains up to X×" is the first card's upper end when the card is
    about the verdict's kind, with the same basis."""
    d = _report(name)
    p = d["primary"]
    recs = d["recommendations"]
    if recs and recs[0]["kind"] == p["kind"] and recs[0]["basis"] != "single-pass":
        assert p["gain"] == pytest.approx(_span(recs[0])[1], abs=1e-3)
        assert p["basis"] == recs[0]["basis"]


def test_overlapping_copies_cannot_hide_the_copy_engines_time() -> None:
    """transfer.after: pinned, non_blocking, 256 MB a step with ~0.5 ms of compute. Overlap can take
    the step down to the copies' own time at best."""
    d = _report("transfer.after.json.gz")
    copies_us = d["breakdown"]["memcpy"] + d["breakdown"]["memset"]
    bound = d["step_time_us"] / copies_us
    for r in d["findings"]:
        if r["kind"] == "transfer":
            assert _span(r)[1] <= bound * 1.02, (r["id"], _span(r), bound)


def test_pinned_estimate_states_its_rate_and_basis() -> None:
    r = _first("transfer")
    assert r["basis"] == "estimate" and r["expected_speedup_range"] is not None
    ev = r["evidence"]
    assert ev["pinned_gbps"] > ev["pageable_gbps"] > 0 and ev["pinned_rate_source"]


def test_precision_estimate_is_device_aware_and_the_tf32_card_ranks_below() -> None:
    """FP32 GEMMs on an H100: bf16's dense peak is ~15× FP32's, TF32's half that. Both cards use the
    same model, so TF32's range lies below autocast's."""
    d = _report("compute_fp32.json.gz")
    amp = d["recommendations"][0]
    tf32 = next(r for r in d["findings"] if r["id"] == "compute.tf32")
    assert _span(tf32)[1] < _span(amp)[1] and _span(tf32)[0] < _span(amp)[0]
    assert "sm_90" in amp["evidence"]["estimate_basis"]


def test_reduced_precision_compute_has_no_cheap_win() -> None:
    d = _report("compute_bf16.json.gz")
    assert d["primary"]["kind"] == "compute" and not d["recommendations"]
    assert any(r["id"] == "compute.no_cheap_win" for r in d["findings"])


def test_empty_cache_in_the_loop_is_named_not_expandable_segments() -> None:
    """memory.json.gz: empty_cache()'s cudaFree calls run outside any op, so the advice removes the
    call; expandable segments would not stop an explicit empty_cache()."""
    r = _first("memory")
    assert "empty_cache()" in r["change"] and "expandable_segments" not in r["change"]
    assert r["evidence"]["frees_outside_ops_per_step"] > 0.5 * r["evidence"]["frees_per_step"]
