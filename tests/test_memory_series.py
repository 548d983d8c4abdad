"""The memory curve stored with each report: faithful peaks, bounded size, one clock with the steps."""

from __future__ import annotations

from pathlib import Path

from stepdoctor_analysis.analyzers.memory import memory_curves
from stepdoctor_analysis.parsing import load_trace
from stepdoctor_analysis.pipeline import analyze_path
from support.synthetic import TraceBuilder


def _sawtooth(path: Path, n: int) -> tuple[Path, int]:
    """``n`` allocations growing then freed in steps, on one CUDA device; returns the true peak."""
    b = TraceBuilder()
    b.step(1, 0.0, float(n) + 10.0)
    b.cpu_op("aten::empty", 0.0, float(n))
    total, peak = 0, 0
    for i in range(n):
        size = 1024 * (i % 97 + 1)
        total = total + size if i % 10 else 0
        peak = max(peak, total)
        b.memory(float(i), size, total, max(total, 1 << 30), addr=i)
    return b.write(path), peak


def test_downsampled_curve_keeps_the_peak_and_the_bound(tmp_path: Path) -> None:
    path, peak = _sawtooth(tmp_path / "t.json", 5000)
    trace = load_trace(path)
    (curve,) = memory_curves(trace, origin_ns=0, max_points=200)
    assert curve["device"] == "cuda:0"
    assert len(curve["t_us"]) <= 200
    assert max(curve["allocated"]) == peak
    assert curve["t_us"] == sorted(curve["t_us"])
    assert curve["reserved"] and max(curve["reserved"]) == 1 << 30


def test_small_curves_are_kept_whole(tmp_path: Path) -> None:
    path, _ = _sawtooth(tmp_path / "t.json", 50)
    (curve,) = memory_curves(load_trace(path), origin_ns=0)
    assert len(curve["t_us"]) == 50


def test_report_series_peaks_match_the_device_peaks(fixtures_dir: Path) -> None:
    report = analyze_path(fixtures_dir / "hta" / "df_index_resolver" / "df_index_resolver.json.gz").to_dict()
    memory = report["metrics"]["memory"]
    peaks = {d["device"]: d["peak_allocated"] for d in memory["devices"]}
    curves = memory["series"]["curves"]
    assert {c["device"] for c in curves} == set(peaks)
    for curve in curves:
        assert max(curve["allocated"]) == peaks[curve["device"]]
    assert memory["series"]["origin_us"] == report["steps"][0]["start_us"]
