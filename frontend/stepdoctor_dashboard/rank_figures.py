"""The run page's rank section: every rank at once, whether the job has 2 ranks or 1,000.

Up to ``SMALL_RUN`` ranks a bar per rank reads best (``figures.ranks_figure``); beyond, one heatmap
of ranks x {step time, busy time before collectives, exposed communication}, each row coloured by
its ratio to the row's median, stragglers marked on the row they were judged by. Plotly draws a
heatmap as one image, so 1,000 ranks cost no DOM rows; the tables beside it are capped (the worst
ranks, the worst nodes, "and N more") and the rest is a paginated view. A click on a rank opens its
trace: each plotly trace names where its trace ids sit in the point's customdata (``meta.trace_at``),
and ``static/rank_click.js`` goes there.

Pure: the typed ``RunVerdict`` and where each rank's trace is (``RankPlace``, from the server),
in; the figure and rows, out. The sentence naming stragglers is the engine's (``ranks.named_ranks``),
the same words ``stepdoctor analyze DIR`` prints.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stepdoctor_analysis.run.ranks import RankSummary, Straggler, named_ranks, worst_first
from stepdoctor_analysis.run.verdict import RunVerdict

from .figures import STRAGGLER_COLOR, Fig, figure, plotly_text, ranks_figure

SMALL_RUN = 32  # up to this many ranks, one bar per rank
TOP_RANKS = 10  # rows of the worst-ranks table
TOP_NODES = 5  # rows of the per-node table
PAGE_RANKS = 100  # rows per page of the paginated rank table
MAX_NODE_TICKS = 24  # node names on the axis (and boundaries) up to this many nodes
# (field of ``RankSummary``, what the page calls it); the order of the heatmap's rows, top down.
METRICS = (
    ("step_time_us", "step time"),
    ("busy_us", "busy before collectives"),
    ("wait_us", "exposed communication"),
)
# The heatmap's row labels: short, so a 400 px screen keeps most of its width for the ranks.
ROW_LABELS = {"step_time_us": "step", "busy_us": "busy", "wait_us": "exposed comm."}
# ``ranks.RankVerdict.basis`` -> the field stragglers were judged on.
BASIS_FIELD = {"busy time before collectives": "busy_us", "step time": "step_time_us"}


@dataclass(frozen=True)
class RankPlace:
    """Where a rank came from: the id of its first trace (the click target) and its host."""

    trace_id: int
    host: str | None = None


@dataclass(frozen=True)
class MetricSpread:
    """One metric over the ranks: what the distribution line prints."""

    name: str
    median_us: float
    p90_us: float
    max_us: float
    max_over_median: float | None  # None when the median is 0
    worst: str  # the label of the rank with the max


@dataclass(frozen=True)
class RankRow:
    """One rank in a capped table."""

    label: str
    host: str | None
    trace_id: int | None
    step_time_us: float
    busy_us: float
    wait_us: float
    over_median: float | None  # the judged metric over the median of all ranks
    straggler: bool


@dataclass(frozen=True)
class NodeRow:
    """One host's ranks: how many, the slowest on the judged metric, and its stragglers."""

    host: str
    ranks: int
    median_us: float
    max_us: float
    worst: str
    stragglers: int


@dataclass(frozen=True)
class RankSection:
    """Everything the rank section of the run page draws."""

    ranks: int
    basis: str
    figure: Fig | None
    spread: list[MetricSpread]
    stragglers_line: str  # "rank 613 (1.30×), rank 7 (1.12×) and 3 more"
    rows: list[RankRow]  # the worst ranks, or one page of all of them
    page: int  # 0: the worst ranks; n >= 1: page n of all ranks by rank id
    pages: int
    nodes: list[NodeRow] = field(default_factory=list)  # the worst nodes first
    more_nodes: int = 0
    page_size: int = PAGE_RANKS

    @property
    def wide(self) -> bool:
        """Too many ranks for a bar each: the heatmap, full width, and the capped rank table."""
        return self.ranks > SMALL_RUN


def rank_label(rank: RankSummary | Straggler) -> str:
    return str(rank.rank) if rank.rank is not None else (rank.worker or "?")


def place_key(rank: RankSummary | Straggler) -> int | str | None:
    """How ``RankPlace`` mappings are keyed: the rank id, else the worker (``host_pid``)."""
    return rank.rank if rank.rank is not None else rank.worker


def place_of(places: Mapping[int | str, RankPlace], rank: RankSummary | Straggler) -> RankPlace | None:
    key = place_key(rank)
    return places.get(key) if key is not None else None


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1) of ``values``; 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def metric_spread(ranks: Sequence[RankSummary]) -> list[MetricSpread]:
    """Median, p90, max and max/median of each metric across the ranks."""
    out = []
    for key, name in METRICS:
        values = [float(getattr(r, key)) for r in ranks]
        if not values:
            continue
        med = statistics.median(values)
        top = max(range(len(values)), key=values.__getitem__)
        out.append(
            MetricSpread(
                name=name,
                median_us=med,
                p90_us=percentile(values, 0.9),
                max_us=values[top],
                max_over_median=values[top] / med if med > 0 else None,
                worst=rank_label(ranks[top]),
            )
        )
    return out


def stragglers_line(stragglers: Sequence[Straggler]) -> str:
    """The stragglers, worst first, named as the engine names ranks in a sentence (a few, then "and N more")."""
    return named_ranks([f"rank {rank_label(s)} ({s.over_median:.2f}×)" for s in worst_first(stragglers)])


def rank_section(
    verdict: RunVerdict, places: Mapping[int | str, RankPlace], page: int = 0
) -> RankSection | None:
    """The rank section of a run of several ranks (None for one rank): figure, distribution, tables."""
    ranks = verdict.ranks
    if len(ranks) < 2:
        return None
    basis = verdict.rank_basis
    judged = BASIS_FIELD.get(basis, "step_time_us")
    late = {place_key(s) for s in verdict.stragglers}
    median = statistics.median(float(getattr(r, judged)) for r in ranks)

    def row(r: RankSummary) -> RankRow:
        place = place_of(places, r)
        value = float(getattr(r, judged))
        return RankRow(
            label=rank_label(r),
            host=place.host if place else None,
            trace_id=place.trace_id if place else None,
            step_time_us=r.step_time_us,
            busy_us=r.busy_us,
            wait_us=r.wait_us,
            over_median=value / median if median > 0 else None,
            straggler=place_key(r) in late,
        )

    pages = math.ceil(len(ranks) / PAGE_RANKS)
    page = min(max(page, 0), pages)
    if page:
        shown = ranks[(page - 1) * PAGE_RANKS : page * PAGE_RANKS]
    else:
        shown = sorted(ranks, key=lambda r: -float(getattr(r, judged)))[:TOP_RANKS]
    nodes = node_rows(ranks, places, judged, late)
    return RankSection(
        ranks=len(ranks),
        basis=basis,
        figure=_figure(verdict, places, judged),
        spread=metric_spread(ranks),
        stragglers_line=stragglers_line(verdict.stragglers),
        rows=[row(r) for r in shown],
        page=page,
        pages=pages,
        nodes=nodes[:TOP_NODES] if len(nodes) > 1 else [],
        more_nodes=max(0, len(nodes) - TOP_NODES) if len(nodes) > 1 else 0,
    )


def node_rows(
    ranks: Sequence[RankSummary], places: Mapping[int | str, RankPlace], judged: str, late: set[Any]
) -> list[NodeRow]:
    """One row per known host, the host with the slowest rank on the judged metric first."""
    by_host: dict[str, list[RankSummary]] = {}
    for r in ranks:
        place = place_of(places, r)
        if place is not None and place.host:
            by_host.setdefault(place.host, []).append(r)
    rows = []
    for host, members in by_host.items():
        values = [float(getattr(r, judged)) for r in members]
        top = max(range(len(values)), key=values.__getitem__)
        rows.append(
            NodeRow(
                host=host,
                ranks=len(members),
                median_us=statistics.median(values),
                max_us=values[top],
                worst=rank_label(members[top]),
                stragglers=sum(place_key(r) in late for r in members),
            )
        )
    return sorted(rows, key=lambda n: (-n.stragglers, -n.max_us, n.host))


def _figure(verdict: RunVerdict, places: Mapping[int | str, RankPlace], judged: str) -> Fig:
    ranks = verdict.ranks
    ids = [_trace_id(places, r) for r in ranks]
    if len(ranks) <= SMALL_RUN:
        spread = {"basis": verdict.rank_basis, "median_busy_us": verdict.median_busy_us}
        fig = ranks_figure(ranks, verdict.stragglers, spread)
        (bar,) = fig["data"]
        bar["customdata"] = [[*c, i] for c, i in zip(bar["customdata"], ids, strict=True)]
        bar["meta"] = {"trace_at": 2}
        return fig
    return heatmap_figure(verdict, places, judged)


def trace_of(places: Mapping[int | str, RankPlace], rank: RankSummary | Straggler) -> int | None:
    """The id of a rank's (first) trace, when the server knows it."""
    place = place_of(places, rank)
    return place.trace_id if place is not None else None


def _trace_id(places: Mapping[int | str, RankPlace], rank: RankSummary | Straggler) -> int:
    place = place_of(places, rank)
    return place.trace_id if place is not None else -1


def heatmap_figure(verdict: RunVerdict, places: Mapping[int | str, RankPlace], judged: str) -> Fig:
    """Ranks (columns, grouped by host when known) x metrics (rows), coloured by the ratio to the
    row's median; the judged row is starred and its stragglers carry a red marker."""
    hosts = {place_key(r): p.host if (p := place_of(places, r)) else None for r in verdict.ranks}
    # Columns by host (hosts in order of their first rank), then by rank: a node's ranks side by side.
    first_at: dict[str | None, int] = {}
    for i, r in enumerate(verdict.ranks):
        first_at.setdefault(hosts[place_key(r)], i)
    order = sorted(range(len(verdict.ranks)), key=lambda i: (first_at[hosts[place_key(verdict.ranks[i])]], i))
    ranks = [verdict.ranks[i] for i in order]
    labels = [rank_label(r) for r in ranks]
    names = [f"{ROW_LABELS[key]} *" if key == judged else ROW_LABELS[key] for key, _ in METRICS]
    # Each column's trace id, rank and host, escaped for plotly's markup once per column, not per
    # cell: ``figure`` would walk all 3 x N cells (most of this figure's cost at 1,000 ranks).
    columns = [
        [_trace_id(places, r), plotly_text(label), plotly_text(hosts[place_key(r)] or "")]
        for r, label in zip(ranks, labels, strict=True)
    ]
    z, custom = [], []
    for key, _ in METRICS:
        values = [float(getattr(r, key)) for r in ranks]
        med = statistics.median(values)
        z.append([round(v / med, 3) if med > 0 else (1.0 if v == 0 else None) for v in values])
        custom.append([[*c, round(v / 1000.0, 3)] for c, v in zip(columns, values, strict=True)])
    heat = {
        "type": "heatmap",
        "x": list(range(len(ranks))),
        "y": names,
        "z": z,
        "meta": {"trace_at": 0},
        "zmin": 0.5,
        "zmid": 1.0,
        "zmax": 1.5,
        "colorscale": [[0.0, "#2166ac"], [0.5, "#f7f7f7"], [1.0, "#b2182b"]],
        "colorbar": {"title": {"text": "×"}, "thickness": 8, "len": 0.9, "xpad": 4},
        "xgap": 0,
        "hovertemplate": "rank %{customdata[1]} %{customdata[2]}<br>%{y}: %{customdata[3]:.3f} ms"
        " (%{z:.2f}× the median)<extra></extra>",
    }
    column = {place_key(r): i for i, r in enumerate(ranks)}
    late = [s for s in worst_first(verdict.stragglers) if place_key(s) in column]
    judged_row = names[[k for k, _ in METRICS].index(judged)]
    marks = {
        "type": "scatter",
        "mode": "markers",
        "name": "straggler",
        "x": [column[place_key(s)] for s in late],
        "y": [judged_row] * len(late),
        "customdata": [[_trace_id(places, s), rank_label(s), round(s.over_median, 3)] for s in late],
        "meta": {"trace_at": 0},
        "marker": {
            "symbol": "diamond",
            "size": 11,
            "color": STRAGGLER_COLOR,
            "line": {"color": "#fff", "width": 1.5},
        },
        "hovertemplate": "straggler: rank %{customdata[1]}, %{customdata[2]:.2f}× the others' median<extra></extra>",
        "showlegend": False,
    }
    notes = [
        {"x": column[place_key(s)], "y": judged_row, "text": f"{rank_label(s)}: {s.over_median:.2f}×",
         "showarrow": True, "arrowhead": 0, "ax": 0, "ay": -34, "font": {"color": STRAGGLER_COLOR}}
        for s in late[:3]
    ]  # fmt: skip
    shapes, ticks = _node_marks([hosts[place_key(r)] for r in ranks], labels)
    fig = figure(
        [heat, marks],
        f"{len(ranks)} ranks · colour: × the row's median · * judged row",
        xaxis=_xaxis(ticks, len(ranks)),
        yaxis={"autorange": "reversed", "automargin": True, "fixedrange": True},
        shapes=shapes,
        annotations=notes,
        height=300,
        margin={"l": 10, "r": 10, "t": 60, "b": 60},
    )
    fig["data"][0]["customdata"] = custom  # escaped above
    return fig


def _node_marks(
    hosts: Sequence[str | None], labels: Sequence[str]
) -> tuple[list[dict[str, Any]], tuple[list[int], list[str]]]:
    """Node boundaries and one tick per node, while there are few nodes; else ticks at ranks."""
    starts = [i for i, h in enumerate(hosts) if i == 0 or h != hosts[i - 1]]
    if hosts and hosts[0] is not None and 1 < len(starts) <= MAX_NODE_TICKS:
        shapes = [
            {"type": "line", "xref": "x", "yref": "paper", "x0": i - 0.5, "x1": i - 0.5, "y0": 0, "y1": 1,
             "line": {"color": "#344054", "width": 1}}
            for i in starts[1:]
        ]  # fmt: skip
        ends = [*starts[1:], len(hosts)]
        return shapes, (
            [(a + b - 1) // 2 for a, b in zip(starts, ends, strict=True)],
            [str(hosts[i]) for i in starts],
        )
    step = max(1, math.ceil(len(labels) / 10))
    at = list(range(0, len(labels), step))
    return [], (at, [labels[i] for i in at])


def _xaxis(ticks: tuple[list[int], list[str]], count: int) -> dict[str, Any]:
    return {
        "title": {"text": "ranks (grouped by node)" if ticks[1] and not ticks[1][0].isdigit() else "rank"},
        "tickmode": "array",
        "tickvals": ticks[0],
        "ticktext": ticks[1],
        "range": [-0.5, count - 0.5],
        "showgrid": False,
        "zeroline": False,
    }
