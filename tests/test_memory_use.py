"""What holds the memory, leaks, fragmentation, near capacity and out-of-memory forensics (``memory_use``,
``rules.memory_advice``): real CPU loops recorded here, synthetic CUDA traces whose memory is made of known parts,
and the real CUDA fixtures."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from stepdoctor_analysis.analyzers.memory_use import CATEGORIES
from stepdoctor_analysis.parsing import load_trace
from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_analysis.report.contract import decode
from stepdoctor_analysis.report.document import render_text
from support import cpu_loops
from support.synthetic import GIB, memory_trace

MIB = 1 << 20


def _report(path: Path) -> dict[str, Any]:
    report = analyze_path(path).to_dict()
    decode(report)  # the new sections are in the contract
    return report


def _card(report: dict[str, Any], rule_id: str) -> dict[str, Any] | None:
    return next((c for c in report["findings"] + report["recommendations"] if c["id"] == rule_id), None)


@pytest.fixture(scope="module")
def loops(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The leaking loop, its fix and an activation-heavy loop, recorded once (a few seconds on 2 cores)."""
    d = tmp_path_factory.mktemp("memory_loops")
    torch.set_num_threads(1)
    return {
        "leak": cpu_loops.kept_graph_loop(d / "leak.json"),
        "fixed": cpu_loops.kept_graph_loop(d / "fixed.json", keep_graph=False),
        "activations": cpu_loops.activation_heavy_loop(d / "act.json"),
    }


# Real CPU loops ----------------------------------------------------------------------------------


def test_a_loss_kept_with_its_graph_is_a_leak_with_its_growth_and_cause(loops: dict[str, Path]) -> None:
    report = _report(loops["leak"])
    card = _card(report, "memory.leak")
    assert card is not None, [c["id"] for c in report["findings"]]
    (leak,) = [x for x in report["metrics"]["memory"]["leak"] if x["steady"]]
    ends = leak["step_end_bytes"]
    assert len(ends) == cpu_loops.ACTIVE and all(b > a for a, b in itertools.pairwise(ends))
    # The evaluation batch is 1024 x 256 floats: its graph keeps the two 1024 x 512 and 1024 x 256
    # activations and the loss's saved tensors, several MiB per step.
    assert leak["growth_per_step"] == pytest.approx((ends[-1] - ends[0]) / (len(ends) - 1))
    assert leak["growth_per_step"] >= 2 * MIB
    assert card["evidence"]["growth_mib_per_step"] == pytest.approx(leak["growth_per_step"] / MIB, abs=0.01)
    top = leak["survivors"][0]
    assert top["phase"] == "forward" and top["op"].startswith("aten::")
    assert "loss.item()" in card["change"] and "losses.append(loss)" in card["change"]
    assert top["op"] in card["why"]
    assert card.get("expected_speedup") in (None, 1.0)  # it averts an OOM, it promises no speed
    text = render_text(analyze_path(loops["leak"]))  # the terminal report shows the fix, not only the why
    assert "Memory grows every step" in text and "losses.append(loss.item())" in text


def test_the_fixed_loop_does_not_leak(loops: dict[str, Path]) -> None:
    report = _report(loops["fixed"])
    assert _card(report, "memory.leak") is None
    (leak,) = report["metrics"]["memory"]["leak"]
    assert leak["growth_per_step"] == 0 and not leak["steady"]


def test_activation_heavy_loop_shares_add_up_and_activations_dominate(loops: dict[str, Path]) -> None:
    report = _report(loops["activations"])
    (cpu,) = report["metrics"]["memory"]["by_category"]
    assert set(cpu["bytes"]) == set(CATEGORIES)
    assert sum(cpu["bytes"].values()) == cpu["allocated"]
    assert sum(cpu["shares"].values()) == pytest.approx(1.0, abs=1e-3)
    peak = next(d for d in report["metrics"]["memory"]["devices"] if d["device"] == "cpu")
    assert cpu["allocated"] == peak["peak_allocated"]
    # 16 tanh outputs of 4096 x 256 floats are saved for backward (64 MiB) against 4 MiB of weights.
    assert cpu["dominant"] == "activations" and cpu["shares"]["activations"] > 0.5
    assert cpu["bytes"]["activations"] >= 64 * MIB
    assert cpu["bytes"]["gradients"] < cpu["bytes"]["activations"] / 10
    series = next(s for s in report["metrics"]["memory"]["series"]["categories"] if s["device"] == "cpu")
    top = max(range(len(series["t_us"])), key=lambda i: sum(v[i] for v in series["categories"].values()))
    assert sum(v[top] for v in series["categories"].values()) == cpu["allocated"]


# Synthetic CUDA traces ---------------------------------------------------------------------------

PARTS: dict[str, dict[str, Any]] = {
    "activations": {
        "params": 4 * GIB,
        "grads": 4 * GIB,
        "state": 8 * GIB,
        "activations": 60 * GIB,
        "inputs": GIB,
    },
    "optimizer_state": {"params": 15 * GIB, "grads": 15 * GIB, "state": 30 * GIB, "activations": 25 * GIB},
    "parameters": {"params": 50 * GIB, "grads": GIB, "state": 2 * GIB, "activations": 20 * GIB},
}
ADVICE = {
    "activations": "torch.utils.checkpoint.checkpoint",
    "optimizer_state": "AdamW8bit",
    "parameters": "Shard the parameters",
}


@pytest.mark.parametrize("dominant", sorted(PARTS))
def test_near_capacity_advice_follows_what_dominates(tmp_path: Path, dominant: str) -> None:
    parts = PARTS[dominant]
    report = _report(memory_trace(tmp_path / "t.json", **parts))
    (cuda,) = report["metrics"]["memory"]["by_category"]
    assert cuda["dominant"] == dominant
    assert sum(cuda["bytes"].values()) == cuda["allocated"]
    held = {
        "activations": parts["activations"],
        "parameters": parts["params"],
        "optimizer_state": parts["state"],
    }
    assert cuda["bytes"][dominant] == held[dominant]
    card = _card(report, "memory.pressure")
    assert card is not None
    assert ADVICE[dominant] in card["change"]
    for other in set(ADVICE) - {dominant}:
        assert ADVICE[other] not in card["change"]
    assert " about " in card["why"] and f"{held[dominant] / GIB:.2f} GiB" in card["why"]  # what it frees


def test_inference_near_capacity_gets_inference_advice(tmp_path: Path) -> None:
    path = memory_trace(
        tmp_path / "t.json", params=30 * GIB, grads=0, state=0, activations=46 * GIB, training=False
    )
    report = _report(path)
    assert report["workload"]["kind"] == "inference"
    card = _card(report, "memory.pressure")
    assert card is not None
    assert "checkpoint" not in card["change"] and "optimizer" not in card["change"].lower()
    assert "batch" in card["change"]
    assert report["metrics"]["memory"]["by_category"][0]["bytes"]["parameters"] == 30 * GIB


def test_below_capacity_gets_no_pressure_card(tmp_path: Path) -> None:
    path = memory_trace(
        tmp_path / "t.json", params=4 * GIB, grads=4 * GIB, state=8 * GIB, activations=20 * GIB
    )
    assert _card(_report(path), "memory.pressure") is None


def test_out_of_memory_event_is_read_with_what_was_allocated_then(tmp_path: Path) -> None:
    parts = {"params": 4 * GIB, "grads": 4 * GIB, "state": 8 * GIB, "activations": 40 * GIB}
    path = memory_trace(tmp_path / "t.json", **parts, oom_request=20 * GIB)
    trace = load_trace(path)
    assert (
        trace.out_of_memory == 1
        and trace.oom_events is not None
        and int(trace.oom_events.bytes[0]) == 20 * GIB
    )
    report = _report(path)
    (oom,) = report["metrics"]["memory"]["out_of_memory_at"]
    assert oom["requested"] == 20 * GIB and oom["device"] == "cuda:0"
    assert oom["allocated"] == 4 * GIB + 8 * GIB + 40 * GIB  # gradients were freed by zero_grad
    assert oom["by_category"]["bytes"]["activations"] == 40 * GIB
    assert oom["by_category"]["dominant"] == "activations"
    card = _card(report, "memory.pressure")
    assert card is not None and "20.00 GiB failed" in card["why"]
    assert oom["rule"] == "memory.pressure" and oom["change"] == card["change"]
    assert "checkpoint" in oom["change"]


def test_fragmented_cache_recommends_expandable_segments(tmp_path: Path) -> None:
    parts = {"params": 4 * GIB, "grads": 4 * GIB, "state": 8 * GIB, "activations": 20 * GIB}
    frag = _report(memory_trace(tmp_path / "frag.json", **parts, reserve_extra=16 * GIB))
    card = _card(frag, "memory.fragmentation")
    assert card is not None and "expandable_segments:True" in card["change"]
    assert card["evidence"]["gap_share_at_peak"] == pytest.approx(16 / 49, abs=0.01)
    assert any("does not help" in c for c in card["caveats"])
    tight = _report(memory_trace(tmp_path / "tight.json", **parts, reserve_extra=GIB // 2))
    assert _card(tight, "memory.fragmentation") is None


def test_growth_that_levels_off_is_not_a_leak(tmp_path: Path) -> None:
    """Optimizer state created in the first profiled step raises one step end only."""
    from support.synthetic import TraceBuilder

    b = TraceBuilder()
    total = 10 * GIB
    for n in range(5):
        b.step(n + 1, 1000.0 * n, 900.0)
        b.cpu_op("aten::empty", 1000.0 * n + 10, 5)
        size = 2 * GIB if n == 0 else MIB * 2 if n < 3 else 0
        if size:
            total += size
            b.memory(1000.0 * n + 11, size, total, total, addr=0x1000 + n)
    report = _report(b.write(tmp_path / "t.json"))
    assert _card(report, "memory.leak") is None


# Real CUDA fixtures ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "cuda/memory.json.gz",
        "cuda/memory.after.json.gz",
        "cuda/input.json.gz",
        "cuda/sync.json.gz",
        "hta/df_index_resolver/df_index_resolver.json.gz",
        "tracelens/h100_google_owlv2-large-patch14-ensemble__1016001.json.gz",
    ],
)
def test_real_traces_have_categories_that_add_up_and_no_false_memory_cards(
    fixtures_dir: Path, name: str
) -> None:
    report = _report(fixtures_dir / name)
    cuda = [c for c in report["metrics"]["memory"]["by_category"] if c["device"].startswith("cuda")]
    assert cuda
    for c in cuda:
        assert sum(c["bytes"].values()) == c["allocated"]
        assert sum(c["shares"].values()) == pytest.approx(1.0, abs=1e-3)
    # Small loops on an 80 GB H100 (and df_index_resolver's 12 GB reserved of a 32 GB V100, 48% above
    # allocated): no leak, nothing fragmented where memory is plentiful, nothing near capacity.
    for rule_id in ("memory.leak", "memory.fragmentation", "memory.pressure"):
        assert _card(report, rule_id) is None, rule_id


# Growth over a whole run (the agent's step series) -------------------------------------------------


def test_run_growth_reads_a_steady_rise_under_spikes_and_not_a_level_one() -> None:
    from stepdoctor_analysis.analyzers.memory_use import LEAK_MIN_MIB_PER_STEP, run_growth

    step = np.arange(0, 4000, 10)  # a sample every 10 steps
    rng = np.random.default_rng(0)
    base = 10 * GIB + rng.integers(0, 64 * MIB, step.size)  # step-end noise below 64 MiB
    spikes = np.where(step % 500 == 0, 8 * GIB, 0)  # capture windows, evaluation: far above the floor
    leak = base + spikes + step * (2 * MIB)
    growth, steady = run_growth(step, leak)
    assert steady and growth == pytest.approx(2 * MIB, rel=0.05)
    for seed in range(20):  # noise alone never reads as a leak (steady and >= the leak threshold)
        noise = np.random.default_rng(seed).integers(0, 64 * MIB, step.size)
        growth, steady = run_growth(step, 10 * GIB + noise + spikes)
        assert not (steady and growth >= LEAK_MIN_MIB_PER_STEP * MIB), seed
    filling = base + np.minimum(step, 600) * (4 * MIB)  # a cache that fills in the first 600 steps
    assert not run_growth(step, filling)[1]
    assert run_growth(step[:6], leak[:6]) == (0.0, False)  # too few samples to tell


def _series_run(spool: Path, *, keep: bool) -> Any:
    """``cpu_loops.host_memory_loop`` in a fresh process, then the run timeline of its step series."""
    from stepdoctor_analysis.run.timeline import read_run_timeline

    return read_run_timeline(cpu_loops.host_memory_run(spool, keep=keep))


def test_host_memory_growing_every_step_over_a_cpu_run_is_a_leak(tmp_path: Path) -> None:
    from stepdoctor_analysis.run.timeline import render_text as timeline_text

    leaking = _series_run(tmp_path / "a", keep=True)
    assert leaking is not None and leaking.memory is not None and leaking.memory.kind in ("rss", "cuda")
    assert leaking.memory.leak and leaking.memory.growth_per_step >= 1.5 * MIB
    assert "grows" in timeline_text(msgspec.to_builtins(leaking))
    fixed = _series_run(tmp_path / "b", keep=False)
    assert fixed is not None and fixed.memory is not None and not fixed.memory.leak


@pytest.mark.parametrize(
    "name",
    [
        "tracelens/mi300_gaunernst_bert-small-uncased__1016001.json.gz",
        "hta/df_index_resolver/df_index_resolver.json.gz",
    ],
)
def test_every_memory_section_names_a_device_the_same_way(fixtures_dir: Path, name: str) -> None:
    """The device list, the drawn curves, the category series and the categories at the peak use one
    name per device (the MI300 trace's device type 6 was 'dev6:0' in one place and 'dev6' in another)."""
    memory = _report(fixtures_dir / name)["metrics"]["memory"]
    devices = {d["device"] for d in memory["devices"]}
    assert {c["device"] for c in memory["series"]["curves"]} == devices
    assert {c["device"] for c in memory["series"]["categories"]} <= devices
    assert {c["device"] for c in memory["by_category"]} <= devices
