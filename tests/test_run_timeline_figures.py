"""The run timeline figure (``timeline_figures.run_timeline_figure``) from the engine's timeline:
what a run page draws, its text escaped for plotly, its size bounded whatever the run's length."""

from __future__ import annotations

from stepdoctor_analysis.run.timeline import run_timeline
from stepdoctor_dashboard.timeline_figures import ANOMALIES_NAME, WINDOWS_NAME, run_timeline_figure
from support.series_chunks import chunk

HOSTILE = '<a href="javascript:alert(1)">x</a>'


def test_windows_anomalies_memory_and_the_steady_line_are_drawn_with_text_escaped() -> None:
    window = {"first_step": 1500, "last_step": 1502, "reason": HOSTILE}
    t = run_timeline(
        [
            chunk("s", 0, 0, 1000, mem_steps=[0, 900]),
            chunk("s", 1, 1000, 1000, profiled=[[1498, 1502]], windows=[window], slow={1200: 300.0}),
        ]
    )
    fig = run_timeline_figure(t)
    by_name = {trace["name"]: trace for trace in fig["data"]}
    windows = by_name[WINDOWS_NAME]
    assert windows["fill"] == "toself" and min(v for v in windows["x"] if v is not None) < 1500
    assert all("<" not in c and "&lt;a href" in c for c in windows["customdata"])
    assert (
        by_name[ANOMALIES_NAME]["x"] == [a.first_step for a in t.anomalies]
        and 1200 in by_name[ANOMALIES_NAME]["x"]
    )
    assert f"steady state, unprofiled: {t.unprofiled_median_ms:.2f} ms" in by_name
    assert by_name["memory (process RSS)"]["yaxis"] == "y2" and fig["layout"]["yaxis2"]["domain"][0] == 0
    assert by_name["waiting for data"]["y"] == t.display.data_ms


def test_a_long_run_draws_at_most_the_display_points() -> None:
    t = run_timeline([chunk("s", i, i * 10_000, 10_000) for i in range(30)])
    fig = run_timeline_figure(t)
    assert t.steps == 300_000 and t.display.bucket == 300
    assert all(len(trace["x"]) <= 1000 for trace in fig["data"])
