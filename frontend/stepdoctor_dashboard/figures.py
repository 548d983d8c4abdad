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
import re
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.io as pio

from stepdoctor_analysis.report.contract import StepRow

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


STRAGGLER_COLOR = "#e45756"
# ``ranks.RankVerdict.basis`` -> the per-rank field stragglers were judged on.
_RANK_METRICS = {"busy time before collectives": "busy_us", "step time": "step_time_us"}


def _get(item: Any, key: str) -> Any:
    """A field of a rank or straggler, stored as JSON (a mapping) or typed (a struct)."""
    return item.get(key) if isinstance(item, Mapping) else getattr(item, key, None)


def _rank_label(item: Any) -> str:
    rank = _get(item, "rank")
    return str(rank) if rank is not None else str(_get(item, "worker") or "?")


def ranks_figure(
    ranks: Sequence[Any], stragglers: Sequence[Any] = (), spread: Mapping[str, Any] | None = None
) -> Fig:
    """One bar per rank of the metric the stragglers were judged by (``spread["basis"]``: busy
    time before the collectives when the job communicates, else step time), stragglers in red with
    their factor over the others' median, the median as a dashed line; step time on hover."""
    basis = str((spread or {}).get("basis") or "step time")
    field = _RANK_METRICS.get(basis, "step_time_us")
    labels = [_rank_label(r) for r in ranks]
    late = {_rank_label(s): _num(_get(s, "over_median")) for s in stragglers}
    values = [_num(_get(r, field)) / 1000.0 for r in ranks]
    bar = {
        "type": "bar",
        "x": labels,
        "y": values,
        "name": basis,
        "marker": {"color": [STRAGGLER_COLOR if label in late else "#4c78a8" for label in labels]},
        "customdata": [
            [_num(_get(r, "step_time_us")) / 1000.0, "straggler" if label in late else ""]
            for r, label in zip(ranks, labels, strict=True)
        ],
        "hovertemplate": "rank %{x}: %{y:.3f} ms " + basis + "<br>step %{customdata[0]:.3f} ms"
        " %{customdata[1]}<extra></extra>",
    }
    shapes, notes = [], []
    median = _num((spread or {}).get("median_busy_us")) / 1000.0
    if median > 0 and field == "busy_us":
        shapes.append(
            {"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": median, "y1": median,
             "line": {"dash": "dash", "color": "#667085", "width": 1}}
        )  # fmt: skip
    for label, factor in late.items():
        if label in labels:
            notes.append(
                {"x": label, "y": values[labels.index(label)], "text": f"straggler {factor:.2f}×",
                 "showarrow": False, "yanchor": "bottom", "font": {"color": STRAGGLER_COLOR}}
            )  # fmt: skip
    return figure(
        [bar],
        f"{basis[0].upper()}{basis[1:]} per rank" + (" (stragglers in red)" if late else ""),
        xaxis=_axis("rank", type="category"),
        yaxis=_axis(f"ms per step, {basis}"),
        shapes=shapes,
        annotations=notes,
    )


def compare_figure(comparison: Mapping[str, Any], base_name: str, other_name: str) -> Fig:
    """Grouped bars per category, before and after."""
    cats = comparison.get("categories") or {}
    names = list(cats)
    data = [
        {"type": "bar", "x": names, "y": [_num(cats[c].get(key)) / 1000.0 for c in names], "name": label}
        for key, label in (("base_us", base_name), ("other_us", other_name))
    ]
    return figure(data, "Before / after, per category", barmode="group", yaxis=_axis("ms per step"))


def memory_figure(
    series: Mapping[str, Any], devices: Sequence[Any] = (), title: str = "Memory over the capture"
) -> Fig | None:
    """Allocated/reserved curves per device from a report's memory series, when the trace had them,
    with each device's capacity (``metrics.memory.devices[].capacity``) as a dashed line."""
    curves = [c for c in series.get("curves") or [] if isinstance(c, Mapping)] if series else []
    if not curves:
        return None
    capacity = {str(_get(d, "device")): _num(_get(d, "capacity")) for d in devices if d is not None}
    data = []
    for curve in curves:
        t = [x / 1000.0 for x in curve.get("t_us") or []]
        label = str(curve.get("device", "device"))
        if capacity.get(label, 0.0) > 0 and t:
            cap = capacity[label]
            data.append(
                {
                    "type": "scatter",
                    "mode": "lines",
                    "x": [min(t), max(t)],
                    "y": [cap / 2**20, cap / 2**20],
                    "name": f"{label} capacity ({cap / 2**30:.1f} GiB)",
                    "line": {"dash": "dash", "color": STRAGGLER_COLOR, "width": 1.5},
                    "hovertemplate": "%{fullData.name}<extra></extra>",
                }
            )
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


# HTA critical-path bound types (``stepdoctor_analysis.analyzers.deep.BOUND_TYPES``), coloured like our kinds.
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


# What a host thread does, from the names of the ops drawn on its lane (the trace has no thread
# names the engine keeps): data loading, the autograd engine's backward pass, or the training loop.
_LOADER_OPS = ("dataloader", "pin_memory", "collate", "__getitem__", "fetch")
_MAIN_OPS = ("enumerate(dataloader)", "optimizer.", "profilerstep", "aten::", "forward")
_HOST_LABEL = re.compile(r"^host (?:thread (?P<tid>-?\d+)|(?P<pid>-?\d+)/(?P<tid2>-?\d+))$")


def lane_titles(lanes: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[str]:
    """Readable lane names: "main thread", "DataLoader worker", "backward thread", else "thread 2",
    "thread 3"... in lane order (a raw id such as "host thread -3" means nothing to a reader);
    "(process P)" is added when the step spans several processes. GPU lanes keep their labels.

    A process's main thread is its busiest host lane running the training loop's ops (``_MAIN_OPS``),
    else its busiest lane that is neither a loader nor the autograd engine (lanes come busiest first).
    """
    role: dict[int, str] = {}
    hosts = [
        (i, m, [names[b[2]].lower() for b in lane.get("boxes") or [] if 0 <= b[2] < len(names)])
        for i, lane in enumerate(lanes)
        if lane.get("kind") == "host" and (m := _HOST_LABEL.match(str(lane.get("label")))) is not None
    ]
    for i, _, ops in hosts:
        if ops and all(any(k in op for k in _LOADER_OPS) for op in ops):
            role[i] = "DataLoader worker"
        elif ops and sum("autograd::engine" in op for op in ops) * 2 > len(ops):
            role[i] = "backward thread"
    pids = {m["pid"] for _, m, _ in hosts if m["pid"]}
    for pid in pids or {None}:  # each process has its main thread
        rest = [(i, ops) for i, m, ops in hosts if i not in role and m["pid"] == pid]
        main = next((i for i, ops in rest if any(k in op for op in ops for k in _MAIN_OPS)), None)
        if main is None and rest:
            main = rest[0][0]
        if main is not None:
            role[main] = "main thread"
    other = 1
    for i, _, _ in hosts:
        if i not in role:
            other += 1
            role[i] = f"thread {other}"
    seen: dict[str, int] = {}
    titles: list[str] = []
    for i, lane in enumerate(lanes):
        if i not in role:
            titles.append(str(lane.get("label")))
            continue
        match = next(m for j, m, _ in hosts if j == i)
        title = role[i] + (f" (process {match['pid']})" if len(pids) > 1 and match["pid"] else "")
        seen[title] = seen.get(title, 0) + 1
        titles.append(title if seen[title] == 1 else f"{title} {seen[title]}")  # "DataLoader worker 2"
    return titles


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
    titles = lane_titles(lanes, names)
    rows = [titles[i] for i in range(len(lanes))]
    data: list[dict[str, Any]] = []
    for i, lane in enumerate(lanes):
        if lane.get("kind") == "charged":
            continue
        boxes = lane.get("boxes") or []
        labels = [names[b[2]] if 0 <= b[2] < len(names) else "?" for b in boxes]
        data.append(
            {
                "type": "bar",
                "orientation": "h",
                "y": [titles[i]] * len(boxes),
                "base": [b[0] / 1000.0 for b in boxes],
                "x": [(b[1] - b[0]) / 1000.0 for b in boxes],
                "marker": {
                    "color": [_op_color(str(lane.get("kind")), n) for n in labels],
                    "line": {"width": 0},  # thin boxes would be all outline
                },
                # Plotly's %{x} on a bar with a base is where the bar ends, so the length is data.
                "customdata": [
                    [_short(n), b[3], (b[1] - b[0]) / 1000.0] for n, b in zip(labels, boxes, strict=True)
                ],
                "hovertemplate": "%{customdata[0]}<br>%{base:.3f} ms + %{customdata[2]:.3f} ms"
                "<br>%{customdata[1]} event(s)<extra></extra>",
                "showlegend": False,
                "name": titles[i],
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
                    "customdata": [(b[1] - b[0]) / 1000.0 for b in mine],
                    "hovertemplate": "%{fullData.name}: %{customdata:.3f} ms at %{base:.3f} ms<extra></extra>",
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
