"""A run's memory leak across the capture windows of one process (``memory_run.run_leak``), reported by the
run's verdict (``run_verdict``, so ``stepdoctor analyze DIR`` and the server's run diagnosis): real CPU loops
recorded over 3 windows, and step ends made of known numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_analysis.run import verdict as rv
from stepdoctor_analysis.run.memory import WindowEnds, run_leak
from stepdoctor_analysis.run.ranks import TraceEntry
from stepdoctor_analysis.run.timeline import Memory
from support import cpu_loops

MIB = 1 << 20


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    """Three windows of the loop that keeps each evaluation loss with its graph, and of its fix, each
    recorded in a fresh process (``cpu_loops.run_fresh``: a leak would inflate later CPU traces here)."""
    d = tmp_path_factory.mktemp("memory_run")
    for name, keep in (("leak", True), ("fixed", False)):
        cpu_loops.run_fresh(
            f"torch.set_num_threads(1); kept_graph_windows(Path({str(d / name)!r}), keep_graph={keep})"
        )
    return {name: sorted((d / name).glob("*.pt.trace.json")) for name in ("leak", "fixed")}


def _entries(paths: list[Path]) -> list[TraceEntry]:
    return [TraceEntry(analyze_path(p).typed(), window=i, worker="host_1234") for i, p in enumerate(paths)]


def _leak(findings: list[Any]) -> Any:
    return next((f for f in findings if f.id == "memory.leak"), None)


def test_a_loss_kept_over_three_windows_is_a_run_level_leak_with_its_growth_and_cause(
    runs: dict[str, list[Path]],
) -> None:
    verdict = rv.run_verdict(_entries(runs["leak"]))
    found = _leak(verdict.findings)
    assert found is not None, [f.id for f in verdict.findings]
    windows = found.evidence["windows"]
    assert len(windows) == 3 and found.traces == 3
    firsts = [w["steps"][0] for w in windows]
    assert firsts == sorted(firsts) and firsts[-1] - firsts[0] >= 2 * cpu_loops.ACTIVE  # steps apart
    floors = [min(w["allocated_mib_at_step_ends"]) for w in windows]
    assert floors[0] < floors[1] < floors[2]  # the lowest step end rises window after window
    # the evaluation graph kept per step: the 1024 x 512 and 1024 x 256 activations and the loss's, ~4 MiB
    assert 2 <= found.evidence["growth_mib_per_step"] <= 8
    assert "host memory only while the profiler records" in found.evidence["basis"], found.evidence
    assert "across 3 capture windows" in found.why and "per step" in found.why
    assert found.evidence["surviving_allocations"][0]["phase"] == "forward"
    assert "losses.append(loss.item())" in found.change
    # the CLI's directory report is the same verdict
    report = analyze_path(runs["leak"][0].parent).to_dict()
    (card,) = [f for f in report["findings"] if f["id"] == "memory.leak"]
    assert card["evidence"]["windows"] == windows


def test_the_fixed_loop_over_three_windows_has_no_leak_and_an_unchanged_verdict(
    runs: dict[str, list[Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = _entries(runs["fixed"])
    verdict = rv.run_verdict(entries)
    assert _leak(verdict.findings) is None
    monkeypatch.setattr(rv, "run_leak", lambda *a, **k: None)  # the verdict as before the run-level leak
    assert msgspec.json.encode(rv.run_verdict(entries)) == msgspec.json.encode(verdict)


def _window(first: int, mib: list[float], device: str = "cuda:0", survivors: Any = ()) -> WindowEnds:
    b = [int(x * MIB) for x in mib]
    growth = (b[-1] - b[0]) / (len(b) - 1)
    return WindowEnds(device, list(range(first, first + len(b))), b, growth, list(survivors))


def test_growth_between_windows_is_a_leak_though_no_window_shows_one() -> None:
    """A leak that strikes between windows (e.g. an evaluation every 10 steps keeping its outputs):
    each window is flat, the floors rise 50 MiB every 10 steps."""
    windows = [_window(10 * k, [100 + 50 * k] * 3) for k in (1, 2, 3)]
    found = run_leak((0, None, [w]) for w in windows)
    assert found is not None and found.growth_per_step == pytest.approx(5 * MIB)
    assert found.process == "rank 0" and "steps 10 to 30" in found.basis
    finding = found.finding()
    assert "the trace does not show which allocations survive" in finding.why  # no window names a cause
    assert finding.confidence == 0.6


def test_windows_of_different_processes_are_not_one_series() -> None:
    """Three ranks, one window each, at rising levels: no process has three windows, no leak."""
    windows = [_window(10, [100 + 50 * k] * 3) for k in range(3)]
    assert run_leak((rank, None, [w]) for rank, w in enumerate(windows)) is None


def test_growth_that_levels_off_or_is_small_is_not_a_run_leak() -> None:
    levelling = [_window(first, [level] * 3) for first, level in ((10, 100), (20, 180), (30, 190))]
    assert run_leak((0, None, [w]) for w in levelling) is None
    small = [_window(10 * k, [100 + 0.5 * k] * 3) for k in (1, 2, 3)]  # 0.05 MiB per step
    assert run_leak((0, None, [w]) for w in small) is None


def test_the_step_series_leak_is_reported_with_the_cause_the_windows_name() -> None:
    cause = [{"op": "aten::addmm", "module": None, "phase": "forward", "bytes_per_step": 2 * MIB}]
    windows = [_window(10 * k, [100, 102, 104], survivors=cause) for k in (1, 2)]  # too few windows alone
    assert run_leak((0, None, [w]) for w in windows) is None
    series = Memory(
        kind="cuda", samples=400, last_bytes=900 * MIB, peak_bytes=900 * MIB, reserved_peak_bytes=None,
        growth_per_step=2.0 * MIB, leak=True,
    )  # fmt: skip
    found = run_leak(((0, None, [w]) for w in windows), series=series)
    assert found is not None and found.from_series and found.growth_per_step == 2 * MIB
    finding = found.finding()
    assert "over the run" in finding.why and "aten::addmm" in finding.why
    assert "step series (400 samples" in finding.evidence["basis"]


def test_the_step_series_of_a_leaking_cpu_run_makes_the_run_leak_that_two_windows_cannot(
    tmp_path: Path,
) -> None:
    """A real CPU run under the agent keeping a 2 MiB tensor every step, 2 capture windows of 2 steps:
    too few for either window or the windows together, but the step series (RSS every step) shows it,
    and ``stepdoctor analyze RUN_DIR``'s verdict reports it; the same run dropping the tensor does not."""
    leaking = cpu_loops.host_memory_run(tmp_path / "a", keep=True, windows=2)
    assert len(list(leaking.glob("*.pt.trace.json.gz"))) == 2
    report = analyze_path(leaking).to_dict()
    (card,) = [f for f in report["findings"] if f["id"] == "memory.leak"]
    assert card["evidence"]["basis"].startswith("the agent's step series")
    assert card["evidence"]["growth_mib_per_step"] >= 1.5 and "over the run" in card["why"]
    fixed = cpu_loops.host_memory_run(tmp_path / "b", keep=False, windows=2)
    assert not [f for f in analyze_path(fixed).to_dict()["findings"] if f["id"] == "memory.leak"]
