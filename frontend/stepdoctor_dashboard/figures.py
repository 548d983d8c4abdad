"""Plotly figures built server-side from stored diagnoses; pages only call ``Plotly.newPlot``.

Pure functions from what the engine and the aggregator store (a report's sections typed, as the
contract's ``ReportDoc`` reads them; a run diagnosis as its JSON) to the figure's plotly JSON: no
database, no request, so they are tested directly. Figures are plain dicts (``Fig``), not
``plotly.graph_objects``: building a ``go.Figure`` validates every property and cost 60-80 ms per
figure, most of a page's server time; plotly.js validates what it draws anyway. The ``plotly_white``
theme travels as JSON in each layout (plotly.js knows no templates by name).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.io as pio

from stepdoctor_analysis.contract import StepRow
from stepdoctor_analysis.ranks import RankSummary

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
_LAYOUT: dict[str, Any] = {"margin": {"l": 60, "r": 20, "t": 40, "b": 40}, "height": 320}
# Legends go under the plot, in rows: eight categories fit a half-width figure without clipping.
_LEGEND_BELOW = {
    "orientation": "h",
    "yanchor": "top",
    "y": -0.45,
    "x": 0,
    "xanchor": "left",
    "traceorder": "normal",
}


class Fig(dict[str, Any]):
    """A figure's plotly JSON, also readable like a ``go.Figure`` (``fig.data[0].x``,
    ``fig.layout.title.text``) so tests and callers read it either way."""

    def __getattr__(self, name: str) -> Any:
        try:
            return _view(self[name])
        except KeyError:
            raise AttributeError(name) from None


def _view(value: Any) -> Any:
    if isinstance(value, dict) and not isinstance(value, Fig):
        return Fig(value)
    if isinstance(value, list):
        return [_view(v) for v in value]
    return value


def figure(data: list[dict[str, Any]], title: str, **layout: Any) -> Fig:
    """A figure in the dashboard's style: white theme, title, the given layout over the defaults.

    Every text in it is ``plotly_text``: names from a trace show as written, never as markup.
    """
    return Fig(
        data=plotly_text(data),
        layout={
            **_LAYOUT,
            "template": _white_template(),
            **plotly_text({"title": {"text": title}, **layout}),
        },
    )


# plotly.js draws every text (trace names, tick labels, hover text, titles) through its own small
# markup language: <b>, <i>, <a href=...>, <br> and entities. A kernel named ``f<a href=...>x</a>``
# would draw as a link reading "x". Text is data, so ``&``, ``<`` and ``>`` go as the entities
# plotly turns back into the characters; only our own hover templates are markup.
_PLOTLY_MARKUP_KEYS = frozenset({"hovertemplate", "texttemplate"})
_PLOTLY_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;"})
_NUMBERS = (float, int)


def plotly_text(value: Any) -> Any:
    """``value`` with every string in it escaped for plotly's text markup (hover templates kept)."""
    if isinstance(value, str):
        return value.translate(_PLOTLY_ESCAPES) if ("<" in value or ">" in value or "&" in value) else value
    if isinstance(value, dict):
        return {k: v if k in _PLOTLY_MARKUP_KEYS else plotly_text(v) for k, v in value.items()}
    if isinstance(value, list | tuple):  # numbers, the bulk of a figure, are kept without a call
        return [v if type(v) in _NUMBERS else plotly_text(v) for v in value]
    return value


def _axis(title: str, **more: Any) -> dict[str, Any]:
    return {"title": {"text": title}, **more}


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def breakdown_figure(breakdown: Mapping[str, Any], title: str = "Average step time breakdown") -> Fig:
    """One horizontal stacked bar: where an average step's wall time goes (µs → ms)."""
    data = [
        {
            "type": "bar",
            "orientation": "h",
            "y": ["step"],
            "x": [_num(value) / 1000.0],
            "name": category,
            "marker": {"color": CATEGORY_COLORS.get(category)},
            "hovertemplate": "%{fullData.name}: %{x:.3f} ms<extra></extra>",
        }
        for category, value in _ordered(breakdown)
    ]
    return figure(
        data,
        title,
        barmode="stack",
        xaxis=_axis("ms per step (TensorBoard's categories)"),
        legend=_LEGEND_BELOW,
        height=280,
        margin={"l": 50, "r": 20, "t": 40, "b": 110},
    )


def shares_figure(shares: Mapping[str, Any], title: str = "Bottleneck shares of step time") -> Fig:
    items = sorted(((k, _num(v)) for k, v in shares.items()), key=lambda kv: -kv[1])
    bar = {
        "type": "bar",
        "x": [k for k, _ in items],
        "y": [v * 100.0 for _, v in items],
        "marker": {"color": [KIND_COLORS.get(k, "#888") for k, _ in items]},
        "hovertemplate": "%{x}: %{y:.1f}%<extra></extra>",
    }
    return figure([bar], title, yaxis=_axis("% of step time"))


def steps_figure(steps: Sequence[StepRow], title: str = "Where each step's time goes") -> Fig:
    """Stacked bars per profiled step of the bottleneck kinds the engine attributed (a typed
    report's ``steps[].kinds``)."""
    labels = [str(s.number) for s in steps]
    kinds = [k for k in KIND_COLORS if any(s.kinds.get(k, 0.0) > 0 for s in steps)]
    data = [
        {
            "type": "bar",
            "x": labels,
            "y": [s.kinds.get(kind, 0.0) / 1000.0 for s in steps],
            "name": kind,
            "marker": {"color": KIND_COLORS[kind]},
        }
        for kind in kinds
    ]
    return figure(
        data,
        title,
        barmode="stack",
        xaxis=_axis("step", type="category"),
        yaxis=_axis("ms"),
        legend=_LEGEND_BELOW,
        height=360,
        margin={"l": 60, "r": 20, "t": 40, "b": 100},
    )


def ranks_figure(ranks: Sequence[RankSummary], title: str = "Step time per rank") -> Fig:
    bar = {
        "type": "bar",
        "x": [r.label for r in ranks],
        "y": [r.step_time_us / 1000.0 for r in ranks],
        "marker": {"color": "#4c78a8"},
    }
    return figure([bar], title, xaxis=_axis("rank", type="category"), yaxis=_axis("ms per step"))


def compare_figure(comparison: Mapping[str, Any], base_name: str, other_name: str) -> Fig:
    """Grouped bars per category, before and after."""
    cats = comparison.get("categories") or {}
    names = list(cats)
    data = [
        {"type": "bar", "x": names, "y": [_num(cats[c].get(key)) / 1000.0 for c in names], "name": label}
        for key, label in (("base_us", base_name), ("other_us", other_name))
    ]
    return figure(data, "Before / after, per category", barmode="group", yaxis=_axis("ms per step"))


def memory_figure(series: Mapping[str, Any], title: str = "Memory over the capture") -> Fig | None:
    """Allocated/reserved curves per device from a report's memory series, when the trace had them."""
    curves = [c for c in series.get("curves") or [] if isinstance(c, Mapping)] if series else []
    if not curves:
        return None
    data = []
    for curve in curves:
        t = [x / 1000.0 for x in curve.get("t_us") or []]
        label = str(curve.get("device", "device"))
        for key in ("allocated", "reserved"):
            if curve.get(key):
                data.append(
                    {
                        "type": "scatter",
                        "mode": "lines",
                        "x": t,
                        "y": [b / 2**20 for b in curve[key]],
                        "name": f"{label} {key}",
                    }
                )
    return figure(
        data, title, xaxis=_axis("ms since the first profiled step"), yaxis=_axis("MiB"), legend=_LEGEND_BELOW
    )


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


def critical_path_figure(result: Mapping[str, Any], title: str = "Critical path by bound type") -> Fig:
    """Bars of a critical-path result's ``breakdown`` (µs → ms), in bound-type order, share on hover."""
    breakdown = result.get("breakdown") or {}
    shares = result.get("shares") or {}
    names = [k for k in BOUND_COLORS if k in breakdown] + sorted(
        k for k in breakdown if k not in BOUND_COLORS
    )
    bar = {
        "type": "bar",
        "x": names,
        "y": [_num(breakdown[k]) / 1000.0 for k in names],
        "customdata": [_num(shares.get(k)) * 100.0 for k in names],
        "marker": {"color": [BOUND_COLORS.get(k, "#bab0ac") for k in names]},
        "hovertemplate": "%{x}: %{y:.3f} ms (%{customdata:.1f}% of the path)<extra></extra>",
    }
    step = result.get("step")
    full_title = f"{title} (step {step})" if step is not None else title
    return figure([bar], full_title, yaxis=_axis("ms on the critical path"))


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


def step_figure(step: Mapping[str, Any], names: Sequence[str]) -> Fig:
    """One step on a time axis: a row per host thread and GPU stream, and a bottom row with every
    stretch coloured by the bottleneck kind it was charged to (from the report's ``timeline``).

    Lanes hold up to a few thousand boxes; each lane is one bar trace with per-box colours.
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
                    "hovertemplate": "%{fullData.name}: %{x:.3f} ms at %{base:.3f} ms<extra></extra>",
                }
            )
    height = 120 + 34 * len(rows)
    return figure(
        data,
        f"Step {step.get('number')} ({step.get('why', '')}): host threads, GPU streams, charged time",
        height=max(300, height + 60),
        margin={"l": 20, "r": 20, "t": 40, "b": 90},
        barmode="overlay",
        bargap=0.25,
        xaxis=_axis("ms since the step began"),
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(rows)), "automargin": True},
        legend={**_LEGEND_BELOW, "y": -0.35 if len(rows) < 4 else -0.2, "title": {"text": "charged to: "}},
    )


def kind_delta_figure(kinds: Mapping[str, Any]) -> Fig:
    """µs per step each bottleneck kind gained (+) or lost (−) from base to other run."""
    items = [(k, _num(v.get("delta_us"))) for k, v in kinds.items() if isinstance(v, Mapping)]
    items = [(k, d) for k, d in items if abs(d) > 0]
    items.sort(key=lambda kv: kv[1])
    bar = {
        "type": "bar",
        "orientation": "h",
        "y": [k for k, _ in items],
        "x": [d / 1000.0 for _, d in items],
        "marker": {"color": ["#12b76a" if d < 0 else "#f04438" for _, d in items]},
        "hovertemplate": "%{y}: %{x:+.3f} ms per step<extra></extra>",
    }
    return figure(
        [bar],
        "Which bottleneck shrank (green) or grew (red)",
        xaxis=_axis("change in ms per step"),
        height=120 + 28 * max(1, len(items)),
    )


@functools.cache
def _white_template() -> dict[str, Any]:
    template: dict[str, Any] = pio.templates["plotly_white"].to_plotly_json()
    return template


def _short(name: str, limit: int = 90) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "…"
