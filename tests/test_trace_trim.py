"""Cutting steps out of a trace: the range asked for, no step more or less, on the traces where the
boundaries touch (CPU: one step's marker ends where the next begins) and where the GPU runs behind."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from stepdoctor_analysis import parsing as parse
from stepdoctor_analysis.model import steps
from stepdoctor_analysis.parsing import trim
from support.dashboard_traces import back_to_back_cpu_steps
from support.synthetic import TraceBuilder


def _gpu_behind_steps(path: Path, n: int = 8) -> Path:
    """Back-to-back host steps launching 300 µs kernels every 30 µs: the GPU falls further behind
    each step, so a step's window (to its last kernel) overlaps the next steps' markers."""
    b = TraceBuilder()
    t, gpu = 100.0, 0.0
    for number in range(1, n + 1):
        start = t
        for _ in range(5):
            b.cpu_op("aten::mm", t, 20)
            begin = max(gpu, t + 15)
            b.launch("void gemm_kernel", t + 5, 8, begin, 300)
            gpu = begin + 300
            t += 30
        b.step(number, start, t - start)
    return b.write(path)


@pytest.mark.parametrize(
    "build", [back_to_back_cpu_steps, _gpu_behind_steps], ids=["cpu-touching", "gpu-behind"]
)
@pytest.mark.parametrize("first,last", [(5, 6), (5, 5), (1, 2), (7, 8)])
def test_trim_keeps_exactly_the_steps_asked_for(
    tmp_path: Path, build: Callable[[Path], Path], first: int, last: int
) -> None:
    src = build(tmp_path / "src.json.gz")
    whole = {s.number: s for s in steps.find_steps(parse.load_trace(src))}
    assert sorted(whole) == list(range(1, 9))
    out = tmp_path / "cut.json.gz"
    trim.trim_trace(src, out, first, last)
    cut = steps.find_steps(parse.load_trace(out))
    assert [s.number for s in cut] == list(range(first, last + 1))


def test_trim_of_touching_steps_keeps_their_windows(tmp_path: Path) -> None:
    src = back_to_back_cpu_steps(tmp_path / "src.json.gz")
    whole = {s.number: (s.start, s.end) for s in steps.find_steps(parse.load_trace(src))}
    out = tmp_path / "cut.json.gz"
    result = trim.trim_trace(src, out, 5, 6)
    cut = {s.number: (s.start, s.end) for s in steps.find_steps(parse.load_trace(out))}
    assert cut == {5: whole[5], 6: whole[6]}
    assert result.dropped > 0
