"""The consistency stage: a report never shows advice that promises nothing, never two findings of
which one denies what the other states, and no bandwidth estimate for copies too small to be
bandwidth-bound. Unit cases, synthetic traces, and an invariant over every trace fixture."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_analysis.report import consistency
from stepdoctor_analysis.report.contract import Recommendation
from stepdoctor_analysis.rules import declared
from support import verdict_traces as vt
from support.fixtures import TRACES
from support.synthetic import TraceBuilder


def _rec(
    rid: str, *, change: str = "do it", gain: float = 1.5, span: tuple[float, float] | None = None
) -> Recommendation:
    return Recommendation(
        id=rid,
        title=rid,
        kind="compute",
        change=change,
        why="",
        expected_speedup=gain,
        removable_us_per_step=1.0,
        confidence=0.5,
        caveats=[],
        evidence={},
        basis="estimate" if span else "measured",
        expected_speedup_range=span,
    )


FACTS = {"a": ("x",), "b": ("no x",), "c": ("y",)}


def _facts(rid: str) -> consistency.Declared:
    return consistency.Declared(FACTS.get(rid, ()), claims_speedup=rid != "averts")


def test_advice_at_or_below_one_percent_is_dropped_facts_stay_without_a_range() -> None:
    recs = [
        _rec("point", gain=1.01),
        _rec("range", gain=1.005, span=(1.0, 1.01)),
        _rec("kept", gain=1.011),
        _rec("fact", change="", gain=1.0, span=(1.0, 1.0)),
        _rec("averts", gain=1.0),  # e.g. memory pressure: the change averts OOM, claims no speedup
    ]
    got = consistency.consistent(recs, _facts)
    assert [r.id for r in got] == ["kept", "fact", "averts"]
    assert got[1].expected_speedup_range is None  # a fact promises no speedup


def test_a_finding_denying_a_higher_ranked_one_is_dropped() -> None:
    got = consistency.consistent([_rec("a"), _rec("c"), _rec("b", change="")], _facts)
    assert [r.id for r in got] == ["a", "c"]
    got = consistency.consistent([_rec("b", change=""), _rec("a")], _facts)
    assert [r.id for r in got] == ["b"]
    assert consistency.contradictions([("a", ("x",)), ("b", ("no x",)), ("c", ("y",))]) == [("a", "b", "x")]


def test_precision_rules_declare_the_facts_their_text_states() -> None:
    """The pairs the report must never show together contradict by their declarations."""
    pairs = [
        ("compute.tf32", "compute.no_cheap_win"),
        ("compute.mixed_precision", "compute.no_cheap_win"),
        ("compute.tf32", "compute.small_matmuls"),
        ("inference.low_precision", "compute.no_cheap_win"),
    ]
    for a, b in pairs:
        assert consistency.contradictions([(a, declared(a).asserts), (b, declared(b).asserts)]), (a, b)


def _ids(recs: list[dict[str, Any]]) -> list[str]:
    return [r["id"] for r in recs]


def bf16_with_some_fp32(path: Path, *, steps: int = 5) -> Path:
    """A100 steps busy with bf16 GEMMs (10 ms) plus 0.4 ms of FP32 SIMT GEMMs: too little FP32 work
    for the mixed-precision card, enough for the TF32 card's estimate to exceed 1.01x."""
    b = TraceBuilder(device_name=vt.DEVICES["sm80"][0], compute_major=8)
    t = 100.0
    for n in range(steps):
        start = t
        t = vt._kernels(b, t, vt.GEMM["bf16"]["sm80"], 40, 250)
        t = vt._kernels(b, t, vt.GEMM["fp32"]["sm80"], 2, 200)
        b.step(n + 1, start, t + 10 - start)
        t += 20
    return b.write(path)


def test_tf32_card_and_already_reduced_precision_never_appear_together(tmp_path: Path) -> None:
    r = analyze_path(bf16_with_some_fp32(tmp_path / "mixed.json")).to_dict()
    ids = _ids(r["findings"])
    tf32 = next(f for f in r["findings"] if f["id"] == "compute.tf32")
    assert tf32["expected_speedup_range"][1] > consistency.MIN_ADVICE_SPEEDUP
    assert "compute.no_cheap_win" not in ids  # it would say "nothing cheap left" next to a TF32 gain
    assert "already run in reduced precision" not in r["primary"]["note"]


def copy_loop(path: Path, *, nbytes: int, steps: int = 6) -> Path:
    """Steps of a 2 ms kernel and 20 exposed pageable HtoD copies of ``nbytes`` each (2-40 µs on the GPU)."""
    b = TraceBuilder(device_name=vt.DEVICES["sm80"][0], compute_major=8)
    t = 100.0
    copy_us = max(2.0, nbytes / 25e3)  # ~25 GB/s, never under the copy's latency
    for n in range(steps):
        start = t
        for _ in range(20):
            b.memcpy("HtoD", t, copy_us + 8, t + 2, copy_us, nbytes)
            t += copy_us + 10
        b.cpu_op("aten::mm", t, 8)
        b.launch(vt.GEMM["bf16"]["sm80"], t + 1, 5, t + 10, 2000)
        t += 2020
        b.step(n + 1, start, t - start)
        t += 10
    return b.write(path)


def test_no_bandwidth_estimate_for_copies_under_64kb(tmp_path: Path) -> None:
    tiny = analyze_path(copy_loop(tmp_path / "tiny.json", nbytes=4)).to_dict()
    assert "transfer.pinned_memory" not in _ids(tiny["findings"])  # no "pinned at 0 GB/s"
    assert all("GB/s" not in f["why"] for f in tiny["findings"])
    bulk = analyze_path(copy_loop(tmp_path / "bulk.json", nbytes=1 << 20)).to_dict()
    card = next(f for f in bulk["recommendations"] if f["id"] == "transfer.pinned_memory")
    assert card["evidence"]["bandwidth_bound_copies_per_step"] == 20
    assert card["expected_speedup_range"][1] > consistency.MIN_ADVICE_SPEEDUP


# --- the invariant over every trace fixture ------------------------------------------------------

FIXTURES = sorted(p for p in TRACES.rglob("*.json.gz"))
# Folders of several traces are analysed as one job (ranks, windows, the straggler card) too; cuda/
# holds separate loops and their fixes (and cases.json), not one job.
JOBS = sorted(
    {p.parent for p in FIXTURES if len(list(p.parent.glob("*.json.gz"))) > 1 and p.parent.name != "cuda"}
)


@functools.cache
def _report(path: Path) -> dict[str, Any]:
    return analyze_path(path).to_dict()


@pytest.mark.parametrize("path", FIXTURES + JOBS, ids=lambda p: str(p.relative_to(TRACES)))
def test_every_fixture_shows_no_empty_promise_and_no_contradiction(path: Path) -> None:
    r = _report(path)
    shown = [*r["recommendations"], *r["findings"]]
    for f in shown:
        if f["change"] and declared(f["id"]).claims_speedup:  # advice: it promises more than 1%
            rng = f["expected_speedup_range"]
            assert (rng[1] if rng else f["expected_speedup"]) > consistency.MIN_ADVICE_SPEEDUP, f["id"]
        else:  # a fact, or a change that averts a failure: no speedup claimed
            assert f["expected_speedup_range"] is None and f["expected_speedup"] == 1.0, f["id"]
    assert consistency.contradictions((f["id"], declared(f["id"]).asserts) for f in r["findings"]) == []
    # Read from the words, independent of the declarations: FP32 GEMMs said to run next to all
    # matmul time in reduced precision.
    whys = " ".join(f["why"] for f in r["findings"])
    assert not ("FP32 GEMMs run" in whys and "(100% of their time in reduced precision)" in whys)
    if "already run in reduced precision" in r["primary"]["note"]:
        assert not {"compute.tf32", "compute.mixed_precision"} & set(_ids(r["findings"]))
