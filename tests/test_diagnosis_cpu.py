"""Labelled CPU cases: tiny real training loops recorded with torch.profiler, one bottleneck each."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_analysis.report.document import Report
from support import cpu_loops

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each loop recorded once for the module (about a second each on 2 cores)."""
    out = tmp_path_factory.mktemp("cpu_loops")
    return {name: fn(out / f"{name}.pt.trace.json") for name, fn in cpu_loops.LOOPS.items()}


def _first(report: Report) -> str:
    assert report.recommendations, "no recommendation"
    return report.recommendations[0].id


def test_single_process_slow_loader_is_input_bound(recorded: dict[str, Path]) -> None:
    report = analyze_path(recorded["input"], metadata={"cpu_count": 8})
    assert report.primary.kind == "input"
    assert report.primary.share > 0.4
    assert _first(report) == "input.dataloader_workers"
    change = report.recommendations[0].change
    # 8 CPUs, one training process: 7 workers, and the settings that keep them fed.
    assert "num_workers=7" in change and "persistent_workers=True" in change
    assert "single-process" in report.recommendations[0].why
    assert report.metrics["input"]["single_process"] is True


def test_same_loader_with_workers_is_not_read_as_single_process(recorded: dict[str, Path]) -> None:
    """Four workers sleep in parallel, so they wait less than the main process loading alone.

    How much less depends on the machine: on 2 cores the workers' collation and the training
    step's threads contend, and the wait that is left may still lead the step. What holds on any
    machine is the loader's kind, the cause stated, and a shorter wait than the serial loader's.
    """
    slow = analyze_path(recorded["input"])
    report = analyze_path(recorded["input_workers"])
    assert report.metrics["input"]["multi_process"] is True
    assert report.metrics["input"]["single_process"] is False
    assert report.metrics["shares"]["input"] < slow.metrics["shares"]["input"]
    for card in report.recommendations:
        if card.id == "input.dataloader_workers":
            assert "single-process" not in card.why
            assert "make __getitem__ cheaper" in card.change


def test_many_tiny_ops_are_launch_bound(recorded: dict[str, Path]) -> None:
    report = analyze_path(recorded["launch"])
    assert report.primary.kind == "launch"
    assert _first(report) == "launch.cpu_overhead"
    assert "torch.compile" in report.recommendations[0].change
    assert report.metrics["ops"]["ops_per_step"] > 500


def test_large_temporaries_are_memory_bound(recorded: dict[str, Path]) -> None:
    report = analyze_path(recorded["memory"])
    assert report.primary.kind == "memory"
    assert _first(report) == "memory.cpu_temporaries"
    cpu = next(d for d in report.metrics["memory"]["devices"] if d["device"] == "cpu")
    # zeros + clone + cat of 32 MB tensors: at least 128 MB allocated per step.
    assert cpu["alloc_bytes_per_step"] >= 128 * 2**20
    assert cpu["capacity"] > 0  # host RAM from the pipeline


def test_big_matmuls_in_memory_are_compute_bound(recorded: dict[str, Path]) -> None:
    report = analyze_path(recorded["compute"])
    assert report.primary.kind == "compute"
    assert _first(report) == "compute.mixed_precision"
    assert 'device_type="cpu"' in report.recommendations[0].change
    assert any("CPUs" in c for c in report.recommendations[0].caveats)
    assert report.device is None


def test_step_kinds_sum_to_step_time(recorded: dict[str, Path]) -> None:
    report = analyze_path(recorded["compute"])
    assert len(report.steps) == cpu_loops.ACTIVE
    for row in report.steps:
        assert sum(row.kinds.values()) == pytest.approx(row.duration_us, rel=1e-6, abs=0.01)
    assert sum(report.breakdown.values()) == pytest.approx(report.step_time_us, rel=1e-3)
