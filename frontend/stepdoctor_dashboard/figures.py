"""Plotly figures built server-side from stored diagnoses; pages only call ``Plotly.newPlot``.

Pure functions from the JSON the engine and the aggregator store to ``go.Figure``: no database,
no request, so they are tested directly.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio

# The TensorBoard profiler plugin's categories, in its priority order, with stable colours.
CATEGORY_COLORS = {
    "kernel": "#4c78a8",
    "memcpy": "#f58518",
    "memset": "#e45756",
    "communication": "#72b7b2",
    "runtime": "#54a24b",
    "dataloader": "#eeca3b",
    "cpu_exec": "#b279a2",
    "other": "#bab0ac",
}
KIND_COLORS = {
    "input": "#eeca3b",
    "transfer": "#f58518",
    "launch": "#54a24b",
    "memory": "#e45756",
    "sync": "#9d755d",
    "communication": "#72b7b2",
    "compute": "#4c78a8",
    "other": "#bab0ac",
}
_LAYOUT = {"margin": {"l": 60, "r": 20, "t": 40, "b": 40}, "template": "plotly_white", "height": 320}
# Legends go under the plot, in rows: eight categories fit a half-width figure without clipping.
_LEGEND_BELOW = {
    "orientation": "h",
    "yanchor": "top",
    "y": -0.45,
    "x": 0,
    "xanchor": "left",
    "traceorder": "normal",
}


def to_json(fig: go.Figure | dict[str, Any]) -> str:
    """Plotly JSON; a figure already built as a plain dict (``step_figure``) is dumped as it is.

    Such figures carry the ``plotly_white`` template as JSON (``_white_template``): plotly.js
    does not know templates by name.
    """
    if isinstance(fig, dict):
        return json.dumps(fig, separators=(",", ":"))
    return str(pio.to_json(fig, validate=False))


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def breakdown_figure(breakdown: Mapping[str, Any], title: str = "Average step time breakdown") -> go.Figure:
    """One horizontal stacked bar: where an average step's wall time goes (µs → ms)."""
    fig = go.Figure()
    for category, value in _ordered(breakdown):
        fig.add_bar(
            y=["step"],
            x=[_num(value) / 1000.0],
            name=category,
            orientation="h",
            marker_color=CATEGORY_COLORS.get(category),
            hovertemplate=f"{category}: %{{x:.3f}} ms<extra></extra>",
        )
    fig.update_layout(
        barmode="stack",
        title=title,
        xaxis_title="ms per step (TensorBoard's categories)",
        legend=_LEGEND_BELOW,
        **{**_LAYOUT, "height": 280, "margin": {"l": 50, "r": 20, "t": 40, "b": 110}},
    )
    return fig


def shares_figure(shares: Mapping[str, Any], title: str = "Bottleneck shares of step time") -> go.Figure:
    items = sorted(((k, _num(v)) for k, v in shares.items()), key=lambda kv: -kv[1])
    fig = go.Figure(
        go.Bar(
            x=[k for k, _ in items],
            y=[v * 100.0 for _, v in items],
            marker_color=[KIND_COLORS.get(k, "#888") for k, _ in items],
            hovertemplate="%{x}: %{y:.1f}%<extra></extra>",
        )
    )
    fig.update_layout(title=title, yaxis_title="% of step time", **_LAYOUT)
    return fig


def steps_figure(report: Mapping[str, Any], title: str = "Where each step's time goes") -> go.Figure:
    """Stacked bars per profiled step of the bottleneck kinds the engine attributed (``steps[].kinds``)."""
    steps = [s for s in report.get("steps") or [] if isinstance(s, Mapping)]
    labels = [str(s.get("number", i)) for i, s in enumerate(steps)]
    kinds = [k for k in KIND_COLORS if any(_num((s.get("kinds") or {}).get(k)) > 0 for s in steps)]
    fig = go.Figure()
    for kind in kinds:
        fig.add_bar(
            x=labels,
            y=[_num((s.get("kinds") or {}).get(kind)) / 1000.0 for s in steps],
            name=kind,
            marker_color=KIND_COLORS[kind],
        )
    fig.update_layout(
        barmode="stack",
        title=title,
        xaxis_title="step",
        xaxis_type="category",
        yaxis_title="ms",
        legend=_LEGEND_BELOW,
        **{**_LAYOUT, "height": 360, "margin": {"l": 60, "r": 20, "t": 40, "b": 100}},
    )
    return fig


def ranks_figure(ranks: Sequence[Mapping[str, Any]], title: str = "Step time per rank") -> go.Figure:
    labels = ["?" if r.get("rank") is None else str(r["rank"]) for r in ranks]
    fig = go.Figure(
        go.Bar(x=labels, y=[_num(r.get("step_time_us")) / 1000.0 for r in ranks], marker_color="#4c78a8")
    )
    fig.update_layout(title=title, xaxis_title="rank", yaxis_title="ms per step", **_LAYOUT)
    return fig


def compare_figure(comparison: Mapping[str, Any], base_name: str, other_name: str) -> go.Figure:
    """Grouped bars per category, before and after."""
    cats = comparison.get("categories") or {}
    names = list(cats)
    fig = go.Figure()
    fig.add_bar(x=names, y=[_num(cats[c].get("base_us")) / 1000.0 for c in names], name=base_name)
    fig.add_bar(x=names, y=[_num(cats[c].get("other_us")) / 1000.0 for c in names], name=other_name)
    fig.update_layout(
        barmode="group", title="Before / after, per category", yaxis_title="ms per step", **_LAYOUT
    )
    return fig


def memory_figure(series: Mapping[str, Any], title: str = "Memory over the capture") -> go.Figure | None:
    """Allocated/reserved curves per device from a report's memory series, when the trace had them."""
    curves = [c for c in series.get("curves") or [] if isinstance(c, Mapping)] if series else []
    if not curves:
        return None
    fig = go.Figure()
    for curve in curves:
        t = [x / 1000.0 for x in curve.get("t_us") or []]
        label = str(curve.get("device", "device"))
        if curve.get("allocated"):
            fig.add_scatter(
                x=t, y=[b / 2**20 for b in curve["allocated"]], name=f"{label} allocated", mode="lines"
            )
        if curve.get("reserved"):
            fig.add_scatter(
                x=t, y=[b / 2**20 for b in curve["reserved"]], name=f"{label} reserved", mode="lines"
            )
    fig.update_layout(
        title=title, xaxis_title="ms since the first profiled step", yaxis_title="MiB", **_LAYOUT
    )
    return fig


# HTA critical-path bound types (``stepdoctor_analysis.deep.BOUND_TYPES``), coloured like our kinds.
BOUND_COLORS = {
    "kernel_kernel_overhead": "#54a24b",
    "launch_overhead": "#88d27a",
    "data_loading": "#eeca3b",
    "cpu": "#b279a2",
    "gpu_compute": "#4c78a8",
    "gpu_memory": "#f58518",
    "communication": "#72b7b2",
}


def critical_path_figure(result: Mapping[str, Any], title: str = "Critical path by bound type") -> go.Figure:
    """Bars of a critical-path result's ``breakdown`` (µs → ms), in bound-type order, share on hover."""
    breakdown = result.get("breakdown") or {}
    shares = result.get("shares") or {}
    names = [k for k in BOUND_COLORS if k in breakdown] + sorted(
        k for k in breakdown if k not in BOUND_COLORS
    )
    fig = go.Figure(
        go.Bar(
            x=names,
            y=[_num(breakdown[k]) / 1000.0 for k in names],
            customdata=[_num(shares.get(k)) * 100.0 for k in names],
            marker_color=[BOUND_COLORS.get(k, "#bab0ac") for k in names],
            hovertemplate="%{x}: %{y:.3f} ms (%{customdata:.1f}% of the path)<extra></extra>",
        )
    )
    step = result.get("step")
    full_title = f"{title} (step {step})" if step is not None else title
    fig.update_layout(title=full_title, yaxis_title="ms on the critical path", **_LAYOUT)
    return fig


def _ordered(values: Mapping[str, Any]) -> list[tuple[str, Any]]:
    known = [(k, values[k]) for k in CATEGORY_COLORS if k in values]
    return known + sorted((k, v) for k, v in values.items() if k not in CATEGORY_COLORS)


# GPU box colours by what the op is (the step figure's host and stream lanes).
_OP_COLORS = {
    "host": "#9aa5b8",
    "kernel": "#4c78a8",
    "memcpy": "#f58518",
    "memset": "#e45756",
    "nccl": "#72b7b2",
}


def _op_color(lane_kind: str, name: str) -> str:
    if lane_kind == "host":
        return _OP_COLORS["host"]
    low = name.lower()
    if low.startswith("memcpy"):
        return _OP_COLORS["memcpy"]
    if low.startswith("memset"):
        return _OP_COLORS["memset"]
    if "nccl" in low:
        return _OP_COLORS["nccl"]
    return _OP_COLORS["kernel"]


def step_figure(step: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """One step on a time axis: a row per host thread and GPU stream, and a bottom row with every
    stretch coloured by the bottleneck kind it was charged to (from the report's ``timeline``).

    Built as the plain plotly JSON dict, not ``go`` objects: their validation costs ~0.1 s per
    thousand boxes on the request path, and these figures hold a few thousand.
    """
    lanes = [lane for lane in step.get("lanes") or [] if isinstance(lane, Mapping)]
    rows = [str(lane.get("label")) for lane in lanes]
    data: list[dict[str, Any]] = []
    for lane in lanes:
        if lane.get("kind") == "charged":
            continue
        boxes = lane.get("boxes") or []
        labels = [names[b[2]] if 0 <= b[2] < len(names) else "?" for b in boxes]
        data.append(
            {
                "type": "bar",
                "orientation": "h",
                "y": [str(lane.get("label"))] * len(boxes),
                "base": [b[0] / 1000.0 for b in boxes],
                "x": [(b[1] - b[0]) / 1000.0 for b in boxes],
                "marker": {
                    "color": [_op_color(str(lane.get("kind")), n) for n in labels],
                    "line": {"width": 0},  # thin boxes would be all outline
                },
                "customdata": [[_short(n), b[3]] for n, b in zip(labels, boxes, strict=True)],
                "hovertemplate": "%{customdata[0]}<br>%{base:.3f} ms + %{x:.3f} ms"
                "<br>%{customdata[1]} event(s)<extra></extra>",
                "showlegend": False,
                "name": str(lane.get("label")),
            }
        )
    charged = next((lane for lane in lanes if lane.get("kind") == "charged"), None)
    if charged is not None:
        label = str(charged.get("label"))
        boxes = charged.get("boxes") or []
        for kind in [k for k in KIND_COLORS if any(b[2] == k for b in boxes)]:
            mine = [b for b in boxes if b[2] == kind]
            data.append(
                {
                    "type": "bar",
                    "orientation": "h",
                    "y": [label] * len(mine),
                    "base": [b[0] / 1000.0 for b in mine],
                    "x": [(b[1] - b[0]) / 1000.0 for b in mine],
                    "marker": {"color": KIND_COLORS[kind], "line": {"width": 0}},
                    "name": kind,
                    "legendgroup": kind,
                    "hovertemplate": f"{kind}: %{{x:.3f}} ms at %{{base:.3f}} ms<extra></extra>",
                }
            )
    height = 120 + 34 * len(rows)
    layout = {
        **_LAYOUT,
        "template": _white_template(),
        "height": max(300, height + 60),
        "margin": {"l": 20, "r": 20, "t": 40, "b": 90},
        "barmode": "overlay",
        "bargap": 0.25,
        "title": {
            "text": f"Step {step.get('number')} ({step.get('why', '')}): host threads, GPU streams, charged time"
        },
        "xaxis": {"title": {"text": "ms since the step began"}},
        "yaxis": {"categoryorder": "array", "categoryarray": list(reversed(rows)), "automargin": True},
        "legend": {**_LEGEND_BELOW, "y": -0.35 if len(rows) < 4 else -0.2, "title": {"text": "charged to: "}},
    }
    return {"data": data, "layout": layout}


def kind_delta_figure(kinds: Mapping[str, Any]) -> go.Figure:
    """µs per step each bottleneck kind gained (+) or lost (−) from base to other run."""
    items = [(k, _num(v.get("delta_us"))) for k, v in kinds.items() if isinstance(v, Mapping)]
    items = [(k, d) for k, d in items if abs(d) > 0]
    items.sort(key=lambda kv: kv[1])
    fig = go.Figure(
        go.Bar(
            y=[k for k, _ in items],
            x=[d / 1000.0 for _, d in items],
            orientation="h",
            marker_color=["#12b76a" if d < 0 else "#f04438" for _, d in items],
            hovertemplate="%{y}: %{x:+.3f} ms per step<extra></extra>",
        )
    )
    fig.update_layout(
        title="Which bottleneck shrank (green) or grew (red)",
        xaxis_title="change in ms per step",
        **{**_LAYOUT, "height": 120 + 28 * max(1, len(items))},
    )
    return fig


@functools.cache
def _white_template() -> dict[str, Any]:
    template: dict[str, Any] = pio.templates["plotly_white"].to_plotly_json()
    return template


def _short(name: str, limit: int = 90) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "…"
