"""What holds the memory, drawn: per device, allocated memory stacked by category over the capture,
the device's capacity as a dashed line, and the peak marked with what was live at that moment.

Pure functions from the typed report (``contract.MemorySection``: ``series.categories`` over time,
``by_category`` at each device's peak, ``devices[].capacity``) to plotly JSON built by
``figures.figure``, so every name from the trace (an op allocating a block) is escaped text. The
peak's point is the report's own ``by_category`` bytes, so the stack at the peak and the page's
hover say the same number as the report's JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stepdoctor_analysis.report.contract import MemoryCategories, MemorySection

from .figures import Fig, figure

# ``memory_use.CATEGORIES``, bottom of the stack first (what stays all run below what comes and
# goes each step), each with a stable colour.
CATEGORY_COLORS = {
    "parameters": "#4c78a8",
    "optimizer_state": "#b279a2",
    "gradients": "#f58518",
    "persistent": "#9d755d",
    "inputs": "#eeca3b",
    "activations": "#e45756",
    "temporaries": "#72b7b2",
}
CAPACITY_COLOR = "#344054"
# A device whose profiled allocations peak below this (a host holding a few scalars next to a GPU)
# says nothing about the run's memory; the largest device is drawn whatever its size.
MIN_DRAWN_PEAK = 2**20
GIB = 2**30
MIB = 2**20


def memory_use_figures(memory: MemorySection) -> dict[str, Fig]:
    """One stacked figure per device with a category series, largest peak first, keyed
    ``memory_use_0``, ``memory_use_1``, ... (the plot ids the trace page draws)."""
    peaks = {p.device: p for p in memory.by_category}
    capacity = {
        str(d.get("device")): _bytes(d.get("capacity")) for d in memory.devices if isinstance(d, Mapping)
    }
    series = [s for s in (memory.series or {}).get("categories") or [] if isinstance(s, Mapping)]
    series.sort(key=lambda s: -(peaks[s["device"]].allocated if s.get("device") in peaks else 0))
    out: dict[str, Fig] = {}
    for s in series:
        device = str(s.get("device"))
        peak = peaks.get(device)
        if out and (peak is None or peak.allocated < MIN_DRAWN_PEAK):
            continue
        fig = memory_use_figure(s, peak, capacity.get(device))
        if fig is not None:
            out[f"memory_use_{len(out)}"] = fig
    return out


def memory_use_figure(
    series: Mapping[str, Any], peak: MemoryCategories | None, capacity: int | None = None
) -> Fig | None:
    """Stacked areas of bytes by category over time on one device (``memory_use.category_series``),
    a dashed horizontal line at ``capacity`` when it is known, and the peak marked: a point on top
    of the stack whose hover lists each category live then and the largest live blocks with the ops
    that allocated them, and a note naming the category that dominates."""
    t_us = [float(t) for t in series.get("t_us") or []]
    columns = {c: list(v) for c, v in (series.get("categories") or {}).items() if c in CATEGORY_COLORS}
    if not t_us or not columns:
        return None
    if peak is not None:
        t_us, columns = _with_peak(t_us, columns, peak)
    device = str(series.get("device") or "device")
    stack_top = max([peak.allocated if peak else 0, *map(sum, zip(*columns.values(), strict=True))])
    unit, scale = ("GiB", GIB) if max(stack_top, capacity or 0) >= GIB else ("MiB", MIB)
    x = [t / 1000.0 for t in t_us]
    data: list[dict[str, Any]] = [
        {
            "type": "scatter",
            "mode": "lines",
            "stackgroup": "memory",
            "name": category,
            "x": x,
            "y": [b / scale for b in columns[category]],
            "line": {"width": 0.5, "color": color},
            "fillcolor": color,
            "hovertemplate": f"%{{fullData.name}}: %{{y:.3f}} {unit}<extra></extra>",
        }
        for category, color in CATEGORY_COLORS.items()
        if category in columns
    ]
    shapes: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    if capacity:
        shapes.append(
            {"type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": "y", "y0": capacity / scale,
             "y1": capacity / scale, "line": {"dash": "dash", "color": CAPACITY_COLOR, "width": 1.5}}
        )  # fmt: skip
        notes.append(
            {"xref": "paper", "x": 1, "xanchor": "right", "y": capacity / scale, "yanchor": "bottom",
             "showarrow": False, "text": f"capacity {capacity / scale:.1f} {unit}",
             "font": {"color": CAPACITY_COLOR}}
        )  # fmt: skip
    if peak is not None:
        lines = _peak_lines(peak, capacity, scale, unit)
        data.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": "peak",
                "x": [peak.at_us / 1000.0],
                "y": [peak.allocated / scale],
                "marker": {"symbol": "diamond", "size": 11, "color": CAPACITY_COLOR},
                "customdata": [lines],
                "hovertemplate": "<br>".join(f"%{{customdata[{i}]}}" for i in range(len(lines)))
                + "<extra></extra>",
            }
        )
        notes.append(
            {"x": peak.at_us / 1000.0, "y": peak.allocated / scale, "ax": 0, "ay": -30, "showarrow": True,
             "arrowhead": 0, "text": _peak_note(peak, scale, unit)}
        )  # fmt: skip
    return figure(
        data,
        f"What holds the memory on {device}",
        xaxis={"title": {"text": "ms since the first profiled step"}},
        yaxis={"title": {"text": f"{unit} allocated"}, "rangemode": "tozero", **_y_range(capacity, scale)},
        updatemenus=_zoom_buttons(stack_top, capacity, scale),
        hovermode="closest",
        legend={"orientation": "h", "yanchor": "top", "y": -0.25, "x": 0, "traceorder": "normal"},
        shapes=shapes,
        annotations=notes,
        height=380,
        margin={"l": 60, "r": 20, "t": 40, "b": 100},
    )


def _y_range(capacity: int | None, scale: int) -> dict[str, Any]:
    """Up to the capacity line and a little above, so the line and its label are always in view."""
    return {"range": [0, capacity / scale * 1.08]} if capacity else {}


def _zoom_buttons(stack_top: int, capacity: int | None, scale: int) -> list[dict[str, Any]]:
    """Where the stack stays far under the capacity (below half), a thin band at the bottom of the
    whole device: two buttons switch between the whole device and the stack filling the plot."""
    if not capacity or stack_top <= 0 or stack_top >= capacity / 2:
        return []
    views = [
        ("whole device", _y_range(capacity, scale)["range"]),
        ("fit the stack", [0, stack_top / scale * 1.1]),
    ]
    buttons = [{"label": label, "method": "relayout", "args": [{"yaxis.range": r}]} for label, r in views]
    return [{"type": "buttons", "direction": "left", "x": 0.5, "xanchor": "center", "y": 1.02, "yanchor": "bottom",
             "pad": {"r": 4, "t": 0}, "showactive": True, "active": 0, "buttons": buttons}]  # fmt: skip


def _with_peak(
    t_us: list[float], columns: dict[str, list[int]], peak: MemoryCategories
) -> tuple[list[float], dict[str, list[int]]]:
    """The series with the peak's instant holding the report's ``by_category`` bytes (replacing the
    sample at that instant, or inserted in time order), so the stack reaches the reported peak."""
    for category, size in peak.bytes.items():
        if size and category in CATEGORY_COLORS and category not in columns:
            columns[category] = [0] * len(t_us)
    at = peak.at_us
    i = next((k for k, t in enumerate(t_us) if t >= at), len(t_us))
    replace = i < len(t_us) and t_us[i] == at
    t_out = [*t_us[:i], at, *t_us[i + replace :]]
    out = {c: [*v[:i], int(peak.bytes.get(c, 0)), *v[i + replace :]] for c, v in columns.items()}
    return t_out, out


def _peak_note(peak: MemoryCategories, scale: int, unit: str) -> str:
    head = f"peak {peak.allocated / scale:.2f} {unit}"
    if peak.dominant is None:
        return head
    return f"{head}: mostly {peak.dominant} ({peak.shares.get(peak.dominant, 0.0):.0%})"


def _peak_lines(peak: MemoryCategories, capacity: int | None, scale: int, unit: str) -> list[str]:
    """The peak's hover, a line each: the total (and its share of capacity), every category live
    then, largest first, and the largest live blocks with the op that allocated each."""
    total = f"peak {peak.allocated / scale:.3f} {unit} allocated at {peak.at_us / 1000.0:.3f} ms"
    if capacity:
        total += f" ({peak.allocated / capacity:.1%} of capacity)"
    lines = [total]
    for category, size in sorted(peak.bytes.items(), key=lambda kv: -kv[1]):
        if size > 0:
            lines.append(f"{category}: {size / scale:.3f} {unit} ({peak.shares.get(category, 0.0):.0%})")
    blocks: Sequence[Mapping[str, Any]] = [b for b in peak.largest if isinstance(b, Mapping)]
    if blocks:
        lines.append("largest live blocks:")
        lines.extend(
            f"  {_bytes(b.get('bytes')) / scale:.3f} {unit} {b.get('category')} ({_op(b.get('op'))})"
            for b in blocks
        )
    return lines


def _op(name: Any, limit: int = 90) -> str:
    text = str(name) if name else "op unknown"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _bytes(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else 0
