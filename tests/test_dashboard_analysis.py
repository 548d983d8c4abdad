"""What the dashboard draws, computed by the engine: operator/kernel tables, the drawn step, trimmed traces."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from stepdoctor_analysis import parsing as parse
from stepdoctor_analysis.model import steps
from stepdoctor_analysis.parsing import trim
from stepdoctor_analysis.pipeline import analyze_path
from support.fixtures import HTA_TRACES, TRACELENS_TRACES
from support.synthetic import launch_bound_trace, sync_bound_trace

BERT = TRACELENS_TRACES / "h100_gaunernst_bert-small-uncased__1016001.json.gz"
TWO_STEPS = HTA_TRACES / "trace_filter" / "sampled_rank-0.json.gz"
NO_MARKERS = HTA_TRACES / "critical_path" / "simple_add" / "benchmark_result_493459_1694039959_trace.json.gz"
CPU = HTA_TRACES / "cpu_only" / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"


@pytest.mark.parametrize("path", [BERT, CPU], ids=["h100-trace", "cpu-trace"])
def test_the_charged_lane_partitions_the_step_exactly_as_the_report(path: Path) -> None:
    report = analyze_path(path).to_dict()
    by_number = {s["number"]: s for s in report["steps"]}
    drawn = report["timeline"]["steps"]
    assert drawn
    for step in drawn:
        charged = next(lane for lane in step["lanes"] if lane["kind"] == "charged")
        totals: Counter[str] = Counter()
        for start, end, kind, _ in charged["boxes"]:
            totals[kind] += end - start
        expected = {k: v for k, v in by_number[step["number"]]["kinds"].items() if v}
        assert set(totals) == set(expected)
        for kind, us in expected.items():
            assert totals[kind] == pytest.approx(us, abs=0.01)
        # Boxes tile the step: sorted, no overlap, ending at the step's end.
        ends = [b[1] for b in charged["boxes"]]
        assert all(b[0] >= prev for b, prev in zip(charged["boxes"][1:], ends, strict=False))
        assert ends[-1] == pytest.approx(step["duration_us"], abs=0.01)


def test_the_drawn_step_has_host_and_gpu_lanes_with_named_boxes(tmp_path: Path) -> None:
    report = analyze_path(launch_bound_trace(tmp_path / "launch.json.gz")).to_dict()
    timeline = report["timeline"]
    step = timeline["steps"][0]
    kinds = Counter(lane["kind"] for lane in step["lanes"])
    assert kinds["host"] >= 1 and kinds["gpu"] >= 1 and kinds["charged"] == 1
    gpu = next(lane for lane in step["lanes"] if lane["kind"] == "gpu")
    assert gpu["boxes"] and all(0 <= b[0] <= b[1] <= step["duration_us"] + 1e-3 for b in gpu["boxes"])
    assert all(0 <= b[2] < len(timeline["names"]) for b in gpu["boxes"])
    assert len(gpu["boxes"]) <= 400  # the lane cap holds
    charged = next(lane for lane in step["lanes"] if lane["kind"] == "charged")
    assert "launch" in {b[2] for b in charged["boxes"]}  # the stretches the verdict is about are drawn


def test_representative_steps_are_median_slowest_and_a_warm_up_outlier() -> None:
    from stepdoctor_analysis.analyzers.step_timeline import representative_steps
    from stepdoctor_analysis.model.trace import Step

    durations = [50, 10, 11, 12, 30]
    chosen = representative_steps([Step(i, i * 100, i * 100 + d) for i, d in enumerate(durations)])
    assert [(s.number, why.split()[0]) for s, why in chosen] == [(0, "slowest"), (3, "median")]
    assert representative_steps([]) == []


def test_tables_rank_ops_and_kernels_by_total_time() -> None:
    tables = analyze_path(BERT).to_dict()["tables"]
    kernels, ops = tables["kernels"], tables["ops"]
    assert kernels and ops
    for rows in (kernels, ops):
        totals = [r["total_us"] for r in rows]
        assert totals == sorted(totals, reverse=True)
        for r in rows:
            assert r["mean_us"] == pytest.approx(r["total_us"] / r["calls"], abs=1e-3)
    assert sum(r["share"] for r in kernels) <= 1.0 + 1e-3
    assert 0.0 < tables["tensor_core_share"] <= 1.0
    assert any(r["tensor_core"] for r in kernels)


def test_trim_keeps_one_step_that_parses_to_the_same_window(tmp_path: Path) -> None:
    original = steps.find_steps(parse.load_trace(TWO_STEPS))
    assert [s.number for s in original] == [551, 552]
    out = tmp_path / "step552.pt.trace.json.gz"
    result = trim.trim_trace(TWO_STEPS, out, 552, 552)
    assert out.stat().st_size < TWO_STEPS.stat().st_size
    assert result.kept > 0 and result.dropped > 0
    doc = json.loads(gzip.decompress(out.read_bytes()))
    source = json.loads(gzip.decompress(TWO_STEPS.read_bytes()))
    # Top-level fields survive; every event is an event of the original.
    assert {k for k in source if k != "traceEvents"} <= set(doc)
    assert doc["distributedInfo"] == source["distributedInfo"]
    assert all(isinstance(e, dict) and "name" in e for e in doc["traceEvents"])
    trimmed = steps.find_steps(parse.load_trace(out))
    assert [(s.number, s.start, s.end) for s in trimmed] == [
        (s.number, s.start, s.end) for s in original if s.number == 552
    ]
    # The analysis of the cut step is the analysis of that step in the whole trace.
    whole = {s["number"]: s for s in analyze_path(TWO_STEPS).to_dict()["steps"]}
    cut = analyze_path(out).to_dict()["steps"]
    assert [s["number"] for s in cut] == [552]
    assert cut[0]["duration_us"] == pytest.approx(whole[552]["duration_us"])


def test_trim_writes_plain_json_for_a_json_name_and_refuses_what_it_cannot_cut(tmp_path: Path) -> None:
    src = sync_bound_trace(tmp_path / "sync.json.gz")
    numbers = [s.number for s in steps.find_steps(parse.load_trace(src))]
    out = tmp_path / "cut.json"
    trim.trim_trace(src, out, numbers[1], numbers[2])
    assert [s.number for s in steps.find_steps(parse.load_trace(out))] == numbers[1:3]
    json.loads(out.read_text())  # plain, valid JSON
    with pytest.raises(trim.TraceError, match="no ProfilerStep markers"):
        trim.trim_trace(NO_MARKERS, tmp_path / "x.json.gz", 1, 1)
    with pytest.raises(trim.TraceError, match="the trace has steps"):
        trim.trim_trace(src, tmp_path / "x.json.gz", 900, 901)
    assert trim.parse_steps("5") == (5, 5) and trim.parse_steps(" 5-6 ") == (5, 6)
    for bad in ("", "a", "6-5", "5-", "-1"):
        with pytest.raises(ValueError):
            trim.parse_steps(bad)


def test_trim_cli_one_line_errors_and_a_summary(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "stepdoctor", "trim", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)

    out = tmp_path / "one.pt.trace.json.gz"
    ok = run(str(TWO_STEPS), str(out), "--steps", "551")
    assert ok.returncode == 0, ok.stderr
    assert "kept" in ok.stdout and out.is_file()
    missing = run(str(TWO_STEPS), str(tmp_path / "no.json.gz"), "--steps", "3-4")
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0 and "551-552" in missing.stderr
    assert not (tmp_path / "no.json.gz").exists()
    assert run(str(TWO_STEPS), str(out), "--steps", "x").returncode == 2


def test_tensorboard_export_makes_a_rank_less_runs_windows_spans_of_one_worker(tmp_path: Path) -> None:
    from stepdoctor_server.runs.export import ExportItem, archive_names

    consts = pytest.importorskip("torch_tb_profiler.consts")
    files = []
    for i in range(3):
        f = tmp_path / f"{i}.json.gz"
        f.write_bytes(gzip.compress(b"{}"))
        files.append(
            ExportItem(f, rank=None, window_index=i if i < 2 else None, host="gpu-box.local", trace_id=10 + i)
        )
    names = [name for name, _ in archive_names("run", files)]
    workers = set()
    for name in names:
        m = consts.WORKER_PATTERN.match(name.split("/", 1)[1])
        assert m is not None, name
        assert consts.NODE_PROCESS_PATTERN.match(m.group(1)) is not None  # the plugin reads a process
        workers.add(m.group(1))
    assert workers == {"gpu-box-local_0"}  # one worker, three spans
    assert len(set(names)) == 3


def test_trimmed_trace_loads_in_torch_tb_profiler(tmp_path: Path) -> None:
    """The plugin's own parser reads the cut file: its steps are the one step asked for."""
    data_mod = pytest.importorskip("torch_tb_profiler.profiler.data")
    out = tmp_path / "worker0.pt.trace.json.gz"
    trim.trim_trace(TWO_STEPS, out, 552, 552)
    profile = data_mod.RunProfileData.parse("worker0", None, str(out), str(tmp_path))
    assert profile.steps_names == ["552"]


@pytest.mark.parametrize("pairs", [1, 3, 16, 17, 60])
def test_busiest_lanes_are_the_same_by_peeling_or_by_sorting(pairs: int) -> None:
    """Few threads/streams are peeled off one at a time, many go through unique+bincount: same answer,
    ties to the lower pair, returned in pair order."""
    from stepdoctor_analysis.analyzers.step_timeline import _busiest, _busiest_sorted

    rng = np.random.default_rng(pairs)
    which = rng.integers(0, pairs, 500)
    a, b = (which // 4).astype(np.int64) * 1000, (which % 4).astype(np.int64) + 7
    dur = rng.integers(1, 5, 500).astype(np.int64) * 100  # coarse: ties happen
    for k in (1, 3, 6):
        got = _busiest(a, b, dur, k)
        assert got == _busiest_sorted(a, b, dur, k)
        totals: dict[tuple[int, int], int] = {}
        for x, y, d in zip(a.tolist(), b.tolist(), dur.tolist(), strict=True):
            totals[(x, y)] = totals.get((x, y), 0) + d
        expected = sorted(sorted(totals), key=lambda p: -totals[p])[:k]
        assert got == sorted(expected)


@pytest.mark.parametrize("seed", range(10))
def test_dominant_bins_give_each_bin_to_the_kind_covering_most_of_it(seed: int) -> None:
    from stepdoctor_analysis.analyzers.step_timeline import _dominant_bins
    from stepdoctor_analysis.model.trace import Step

    rng = np.random.default_rng(seed)
    step = Step(number=1, start=1_000, end=1_000 + int(rng.integers(50, 400)))
    cuts = np.unique(rng.integers(step.start + 1, step.end, int(rng.integers(1, 40))))
    edges = np.concatenate([[step.start], cuts, [step.end]]).astype(np.int64)
    owner = rng.integers(0, 4, edges.size - 1)
    kinds = ["compute", "launch", "sync", "other"]
    parts = [(kind, (edges[:-1][owner == i], edges[1:][owner == i])) for i, kind in enumerate(kinds)]
    names, lo, hi, code = _dominant_bins(parts, step, 16)
    covered = np.zeros((len(names), step.end - step.start), bool)  # one cell per ns
    for kind, (s, e) in parts:
        for x, y in zip(s.tolist(), e.tolist(), strict=True):
            covered[names.index(kind), x - step.start : y - step.start] = True
    for j, (a, b) in enumerate(zip(lo.tolist(), hi.tolist(), strict=True)):
        per_kind = covered[:, a - step.start : b - step.start].sum(axis=1)
        assert per_kind[code[j]] == per_kind.max()
