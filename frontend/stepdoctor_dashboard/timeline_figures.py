"""The whole run, drawn: step time over every step the agent timed, capture windows shaded,
anomalies marked, the data wait beside it and memory below, from the engine's ``RunTimeline``.

Pure: the engine's typed timeline in, plotly JSON out (``figures.figure``, so every text is escaped
for plotly's markup). It draws ``RunTimeline.display`` (at most ~1,000 points whatever the run's
length: 10 million steps draw as fast as 10 thousand); the statistics the page states beside it
(steady-state median, throughput) are the timeline's own, computed over every step.
"""

from __future__ import annotations

from typing import Any

from stepdoctor_analysis.run.timeline import RunTimeline

from .figures import _LEGEND_BELOW, Fig, figure

STEP_COLOR = "#4c78a8"
MAX_COLOR = "#9ecae9"
DATA_COLOR = "#eeca3b"
MEMORY_COLOR = "#54a24b"
ANOMALY_COLOR = "#e45756"
WINDOW_FILL = "rgba(245, 133, 24, 0.22)"
STEADY_COLOR = "#344054"
#: Names of the figure's traces (the browser test finds them by name).
WINDOWS_NAME = "capture windows"
#: A window is drawn at least 1/250 of the x axis wide (its hover says its real steps).
MIN_WINDOW_SPANS = 250
ANOMALIES_NAME = "anomalies"


def run_timeline_figure(t: RunTimeline) -> Fig:
    """Step time (median and slowest per bucket of steps) and data wait on top, memory below
    when sampled; capture windows as shaded spans, anomalies as red marks, the steady-state
    unprofiled median as a dashed line."""
    d = t.display
    per = "" if d.bucket == 1 else f" (median of each {d.bucket:,} steps)"
    data: list[dict[str, Any]] = [
        {
            "type": "scatter",
            "mode": "lines",
            "name": f"step time{per}",
            "x": d.step,
            "y": d.median_ms,
            "line": {"color": STEP_COLOR, "width": 1.5},
            "hovertemplate": "step %{x}: %{y:.2f} ms<extra></extra>",
        }
    ]
    if d.bucket > 1:
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": "slowest step of each bucket",
                "x": d.step,
                "y": d.max_ms,
                "line": {"color": MAX_COLOR, "width": 1},
                "hovertemplate": "from step %{x}: slowest %{y:.2f} ms<extra></extra>",
            }
        )
    if d.data_ms is not None:
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": "waiting for data",
                "x": d.step,
                "y": d.data_ms,
                "line": {"color": DATA_COLOR, "width": 1.5},
                "hovertemplate": "step %{x}: %{y:.2f} ms waiting for data<extra></extra>",
            }
        )
    top = max([*d.max_ms, *(d.data_ms or []), t.unprofiled_median_ms or 0.0, 1e-3]) * 1.05
    first, last = (d.step[0], d.step[-1] + d.bucket - 1) if d.step else (0, max(0, t.steps - 1))
    if t.windows:
        xs: list[float | None] = []
        ys: list[float | None] = []
        least = (last - first) / MIN_WINDOW_SPANS  # a 3-step window in 10 million steps stays visible
        for w in t.windows:
            a, b = w.first_step - 0.5, w.last_step + 0.5
            if b - a < least:
                mid = (a + b) / 2
                a, b = mid - least / 2, mid + least / 2
            xs += [a, a, b, b, a, None]
            ys += [0, top, top, 0, 0, None]
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": WINDOWS_NAME,
                "x": xs,
                "y": ys,
                "fill": "toself",
                "fillcolor": WINDOW_FILL,
                "line": {"width": 0},
                "customdata": [
                    f"{w.first_step}-{w.last_step} ({w.reason})" for w in t.windows for _ in range(6)
                ],
                "hovertemplate": "capture window, steps %{customdata}<extra></extra>",
            }
        )
    if t.unprofiled_median_ms is not None:
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": f"steady state, unprofiled: {t.unprofiled_median_ms:.2f} ms",
                "x": [first, last],
                "y": [t.unprofiled_median_ms, t.unprofiled_median_ms],
                "line": {"color": STEADY_COLOR, "width": 1, "dash": "dash"},
                "hovertemplate": "steady-state unprofiled median: %{y:.2f} ms<extra></extra>",
            }
        )
    if t.anomalies:
        data.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": ANOMALIES_NAME,
                "x": [a.first_step for a in t.anomalies],
                "y": [a.max_ms for a in t.anomalies],
                "marker": {"color": ANOMALY_COLOR, "symbol": "x", "size": 9},
                "customdata": [
                    [a.last_step, a.median_ms, "captured" if a.captured else "not captured"]
                    for a in t.anomalies
                ],
                "hovertemplate": "slow steps %{x}-%{customdata[0]}: up to %{y:.1f} ms against a median of "
                "%{customdata[1]:.2f} ms (%{customdata[2]})<extra></extra>",
            }
        )
    layout: dict[str, Any] = {
        "height": 460,
        "legend": {**_LEGEND_BELOW, "y": -0.18},
        "margin": {"l": 60, "r": 20, "t": 40, "b": 40},
        "xaxis": {"title": {"text": "step"}, "anchor": "y2" if d.memory_mib else "y", "range": [first, last]},
        "yaxis": {
            "title": {"text": "ms"},
            "rangemode": "tozero",
            "domain": [0.34, 1.0] if d.memory_mib else [0, 1],
        },
    }
    if d.memory_mib:
        kind = "CUDA allocated" if t.memory is not None and t.memory.kind == "cuda" else "process RSS"
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": f"memory ({kind})",
                "x": d.step,
                "y": d.memory_mib,
                "yaxis": "y2",
                "line": {"color": MEMORY_COLOR, "width": 1.5},
                "hovertemplate": "step %{x}: %{y:,.0f} MiB<extra></extra>",
            }
        )
        layout["yaxis2"] = {"title": {"text": "MiB"}, "domain": [0, 0.24], "rangemode": "tozero"}
    title = f"Every step: {t.steps:,} timed"
    return figure(data, title, **layout)
