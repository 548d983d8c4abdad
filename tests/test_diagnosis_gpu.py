"""Labelled GPU cases from synthetic Kineto traces whose bottleneck is known by construction."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepdoctor_analysis.analyzers.sync import analyze_sync
from stepdoctor_analysis.analyzers.transfers import analyze_transfers
from stepdoctor_analysis.model.steps import find_steps
from stepdoctor_analysis.parsing import load_trace
from stepdoctor_analysis.pipeline import analyze_path
from support import synthetic


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("synthetic")
    return {
        "transfer": synthetic.pageable_transfer_trace(out / "transfer.json.gz"),
        "launch": synthetic.launch_bound_trace(out / "launch.json"),
        "sync": synthetic.sync_bound_trace(out / "sync.json"),
        "communication": synthetic.exposed_nccl_trace(out / "nccl.json"),
        "memory": synthetic.allocator_churn_trace(out / "alloc.json"),
    }


@pytest.mark.parametrize(
    ("case", "first_rec", "change_mentions"),
    [
        ("transfer", "transfer.pinned_memory", "pin_memory=True"),
        ("launch", "launch.cuda_graphs", 'mode="reduce-overhead"'),
        ("sync", "sync.host_sync", "aten::item"),
        ("communication", "communication.overlap", "no_sync()"),
        ("memory", "memory.allocator_steady_state", "expandable_segments:True"),
    ],
)
def test_primary_kind_and_next_optimization(
    traces: dict[str, Path], case: str, first_rec: str, change_mentions: str
) -> None:
    report = analyze_path(traces[case])
    assert report.primary.kind == case
    assert report.primary.share > 0.5
    assert report.recommendations[0].id == first_rec
    assert report.recommendations[0].kind == case
    assert change_mentions in report.recommendations[0].change
    assert report.recommendations[0].expected_speedup > 1.5
    # Ranked by upper-bound speedup.
    speedups = [r.expected_speedup for r in report.recommendations]
    assert speedups == sorted(speedups, reverse=True)


def test_pageable_copy_metrics(traces: dict[str, Path]) -> None:
    trace = load_trace(traces["transfer"])
    stats = analyze_transfers(trace, find_steps(trace))
    htod = stats.direction("HtoD")
    assert htod is not None
    assert htod.bytes_per_step == 64 << 20
    assert htod.pageable_count_per_step == 1 and htod.pinned_count_per_step == 0
    # 64 MiB in 12 ms of device time.
    assert htod.bandwidth_gbps == pytest.approx((64 << 20) / 12e6, rel=1e-3)
    # Nothing overlaps the copy, so all of it is exposed.
    assert stats.exposed_ns_per_step == pytest.approx(12e6, rel=1e-3)


def test_sync_triggers_are_the_user_facing_op(traces: dict[str, Path]) -> None:
    trace = load_trace(traces["sync"])
    stats = analyze_sync(trace, find_steps(trace))
    # Per step: 20 .item() calls, each a pageable DtoH copy plus a cudaStreamSynchronize.
    assert stats.calls_per_step == 40
    assert stats.by_api["cudaStreamSynchronize"] == 20 * 5
    assert stats.triggers[0].op == "aten::item"
    assert stats.triggers[0].count == 200


def test_exposed_communication_and_overlap(traces: dict[str, Path]) -> None:
    report = analyze_path(traces["communication"])
    comm = report.metrics["communication"]
    assert comm["exposed_ns_per_step"] == pytest.approx(6e6, rel=1e-3)
    assert comm["overlapped_ns_per_step"] == 0
    assert report.rank == 0 and report.world_size == 2


def test_directory_reports_ranks_and_straggler(tmp_path: Path) -> None:
    synthetic.exposed_nccl_trace(tmp_path / "rank0.json", rank=0)
    synthetic.exposed_nccl_trace(tmp_path / "rank1.json", rank=1, slow=1.5)
    report = analyze_path(tmp_path)
    d = report.to_dict()
    assert d["ranks"]["count"] == 2
    assert d["ranks"]["stragglers"] == [1]
    assert d["rank"] == 1  # the top-level diagnosis is the straggler's: the others wait for it
    assert d["ranks"]["straggler_details"][0]["cause"] == "compute"
    assert d["ranks"]["spread"] > 0.1
    assert {r["rank"] for r in d["ranks"]["per_rank"]} == {0, 1}
    only = analyze_path(tmp_path, rank=0)
    assert only.rank == 0 and only.ranks is None


def test_memory_pressure_and_allocator_findings(traces: dict[str, Path]) -> None:
    report = analyze_path(traces["memory"])
    ids = [f.id for f in report.findings]
    assert "memory.pressure" in ids and "memory.allocator_steady_state" in ids
    dev = report.metrics["memory"]["devices"][0]
    assert dev["device"] == "cuda:0"
    # Reserved peaks at 90% of 80 GiB + 1 GiB: above the 90% pressure line.
    assert dev["peak_fraction"] == pytest.approx(
        (int(synthetic.A100_MEM * 0.9) + (1 << 30)) / synthetic.A100_MEM
    )
    # One cudaFree + one cudaMalloc per step after the first.
    assert report.metrics["memory"]["steady_alloc_calls_per_step"] == 2
