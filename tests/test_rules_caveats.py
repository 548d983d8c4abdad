"""Caveats are rendered for the device the trace ran on (a GPU run gets no CPU-only advice)."""

from __future__ import annotations

from pathlib import Path

from stepdoctor_analysis.pipeline import analyze_path


def test_mixed_precision_caveat_fits_a_gpu_trace(fixtures_dir: Path) -> None:
    report = analyze_path(fixtures_dir / "hta" / "trace_diff" / "control" / "control.json.gz")
    rec = next(r for r in report.recommendations if r.id == "compute.mixed_precision")
    assert 'device_type="cuda"' in rec.change
    assert any("sm_80" in c for c in rec.caveats), "the caveat names the device's architecture"
    assert not any("CPU" in c for c in rec.caveats)
    assert not any("{" in c for c in rec.caveats), "caveat templates must be filled in"
