"""Pure pieces of the diagnosis: the speedup formula, thresholds, loader advice, rank spread, JSON safety."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from stepdoctor_analysis.analyzers.inputs import loader_settings, suggested_workers
from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_analysis.report.document import plain
from stepdoctor_analysis.rules import KINDS, RULES
from stepdoctor_analysis.rules.record import Hit, Rule, speedup
from stepdoctor_analysis.run.ranks import TraceEntry, rank_verdict
from support import synthetic
from support.reports import typed


def test_speedup_is_total_over_remaining() -> None:
    assert speedup(100.0, 50.0) == pytest.approx(2.0)
    assert speedup(100.0, 0.0) == pytest.approx(1.0)
    assert speedup(0.0, 10.0) == 1.0
    assert math.isfinite(speedup(100.0, 100.0))  # capped, never a division by zero


def test_rule_fires_only_above_its_threshold() -> None:
    def query(metric: float) -> Rule:
        return Rule(
            id="t.x",
            kind="sync",
            title="t",
            trigger="metric > 0.1",
            threshold=0.1,
            query=lambda _ctx, _lim: Hit(metric, 5.0, {}),
            change="c",
            why="w",
        )

    assert query(0.05).evaluate(None) is None  # type: ignore[arg-type]
    hit = query(0.3).evaluate(None)  # type: ignore[arg-type]
    assert hit is not None and hit.confidence is not None and 0.5 < hit.confidence <= 0.95


def test_rules_are_unique_and_use_the_vocabulary() -> None:
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids))
    assert {r.kind for r in RULES} <= set(KINDS)
    assert set(KINDS) <= {r.kind for r in RULES}  # every kind has at least one fix
    assert all(r.trigger and r.why and r.threshold > 0 for r in RULES)


def test_loader_settings_from_agent_metadata_shape() -> None:
    md = {
        "cpu_count": 16,
        "local_world_size": 2,
        "loader": {"num_workers": 0, "pin_memory": False, "type": "DataLoader"},
    }
    s = loader_settings(md)
    assert s.num_workers == 0 and s.pin_memory is False and s.cpu_count == 16
    assert suggested_workers(s) == 7  # 16 CPUs / 2 processes, one core left for the training loop
    assert suggested_workers(loader_settings({"loader": None})) == 4  # nothing known: a safe default
    assert (
        suggested_workers(loader_settings({"cpu_count": 4, "loader": {"num_workers": 3}})) == 6
    )  # already 3: double


def test_rank_spread_names_the_slow_rank() -> None:
    def spread(times: dict[int, float]):  # type: ignore[no-untyped-def]
        return rank_verdict([TraceEntry(typed(step_time_us=t), rank=r) for r, t in times.items()])

    verdict = spread({0: 100.0, 1: 101.0, 2: 99.0, 3: 130.0})
    assert verdict.straggler_ranks() == [3]
    assert verdict.spread == pytest.approx((130 - 99) / 100.5)
    assert spread({0: 100.0, 1: 105.0}).stragglers == []


def test_plain_makes_json_safe_values() -> None:
    out = plain({"a": np.float32(1.5), "b": np.array([1, 2]), "c": float("nan"), 3: (np.int64(4),)})
    assert out == {"a": 1.5, "b": [1, 2], "c": None, "3": [4]}
    json.dumps(out, allow_nan=False)


def test_trace_anti_patterns(tmp_path: Path) -> None:
    """Single-tensor optimizer, zero_grad filling zeros, and FP32 SIMT GEMMs on an sm_80 GPU."""
    b = synthetic.TraceBuilder()
    t = 100.0
    for n in range(3):
        start = t
        b.launch("ampere_sgemm_128x64_nn", t, 8, t + 10, 2_000)
        t += 2_100
        b.annotation("Optimizer.zero_grad#AdamW.zero_grad", t, 300)
        for i in range(10):
            b.cpu_op("aten::zero_", t + 5 + 25 * i, 20)
        t += 320
        b.annotation("Optimizer.step#AdamW.step", t, 1_300)
        for i in range(40):
            b.cpu_op("aten::add_", t + 5 + 30 * i, 25)
        t += 1_320
        b.step(n + 1, start, t - start)
        t += 10
    report = analyze_path(b.write(tmp_path / "patterns.json"))
    ids = {f.id for f in report.findings}
    assert {"launch.foreach_optimizer", "memory.zero_grad_set_to_none", "compute.tf32"} <= ids
    foreach = next(f for f in report.findings if f.id == "launch.foreach_optimizer")
    assert foreach.evidence["elementwise_ops_per_step"] == 40
    assert "foreach=True" in foreach.change
    tf32 = next(f for f in report.findings if f.id == "compute.tf32")
    assert tf32.evidence["kernels"] == ["ampere_sgemm_128x64_nn"]


def test_tensor_core_gemm_is_not_flagged(tmp_path: Path) -> None:
    b = synthetic.TraceBuilder()
    b.launch("cutlass_80_tensorop_s1688gemm_64x64_16x6_nn_align4", 100, 8, 110, 2_000)
    b.step(1, 90, 2_100)
    report = analyze_path(b.write(tmp_path / "tc.json"))
    assert "compute.tf32" not in {f.id for f in report.findings}


def test_host_memory_comes_from_metadata_or_this_host() -> None:
    import socket

    from stepdoctor_analysis.pipeline import _host_memory

    assert _host_memory({"host_memory_bytes": 123}) == 123
    assert _host_memory({"host": "some-other-node"}) == 0  # never our RAM for someone else's host
    assert _host_memory({"host": socket.gethostname()}) > 0
    assert _host_memory(None) > 0
