"""The stacked memory view (``memory_figures``): categories stacked to the reported peak, the
device's capacity as a line only when it is known, and the peak marked with what was live then;
from a synthetic section and from the engine's report of the H100 ``empty_cache`` loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_analysis import pipeline
from stepdoctor_analysis.report import contract
from stepdoctor_analysis.report.contract import MemoryCategories, MemorySection
from stepdoctor_dashboard.memory_figures import memory_use_figure, memory_use_figures
from support import cpu_loops
from support.dashboard import page_plots
from support.server import drain, logged_in, upload

MIB = 2**20
GIB = 2**30
CUDA_MEMORY = Path(__file__).parent / "fixtures" / "traces" / "cuda" / "memory.json.gz"


def _peak(**over: Any) -> MemoryCategories:
    sizes = {"parameters": 100 * MIB, "activations": 300 * MIB, "temporaries": 50 * MIB}
    total = sum(sizes.values())
    fields: dict[str, Any] = {
        "device": "cuda:0",
        "at_us": 2500.0,  # between the series' samples: the figure puts the peak in
        "allocated": total,
        "reserved": total + 64 * MIB,
        "bytes": sizes,
        "shares": {c: b / total for c, b in sizes.items()},
        "dominant": "activations",
        "basis": "phases",
        "largest": [{"bytes": 200 * MIB, "category": "activations", "op": "aten::<a href='x'>mm</a>"}],
    }
    return MemoryCategories(**(fields | over))


SERIES = {
    "device": "cuda:0",
    "t_us": [0.0, 1000.0, 2000.0, 3000.0],
    "categories": {
        "parameters": [100 * MIB] * 4,
        "activations": [0, 150 * MIB, 250 * MIB, 0],
        "temporaries": [0, 10 * MIB, 20 * MIB, 5 * MIB],
    },
}


def _stack_at(fig: Any, x: float) -> dict[str, float]:
    return {t["name"]: t["y"][t["x"].index(x)] for t in fig["data"] if t.get("stackgroup")}


def test_categories_stack_to_the_reported_peak_under_the_capacity_line() -> None:
    peak = _peak()
    fig = memory_use_figure(SERIES, peak, capacity=int(0.5 * GIB))
    assert fig is not None
    stacked = [t for t in fig["data"] if t.get("stackgroup")]
    assert {t["stackgroup"] for t in stacked} == {"memory"}  # one stack, not overlapping areas
    assert [t["name"] for t in stacked] == ["parameters", "activations", "temporaries"]
    at_peak = _stack_at(fig, 2.5)  # ms
    assert at_peak == {c: b / MIB for c, b in peak.bytes.items()}  # MiB: the total is under 1 GiB
    assert sum(at_peak.values()) == pytest.approx(peak.allocated / MIB)
    assert max(sum(t["y"][i] for t in stacked) for i in range(5)) == pytest.approx(peak.allocated / MIB)
    (line,) = fig["layout"]["shapes"]
    assert line["y0"] == line["y1"] == 512.0 and line["line"]["dash"] == "dash"
    assert fig["layout"]["yaxis"]["title"]["text"] == "MiB allocated"
    assert fig["layout"]["updatemenus"] == []  # 450 of 512 MiB: the stack already fills the plot
    notes = [a["text"] for a in fig["layout"]["annotations"]]
    assert "capacity 512.0 MiB" in notes
    assert "peak 450.00 MiB: mostly activations (67%)" in notes
    (marker,) = [t for t in fig["data"] if t["name"] == "peak"]
    lines = marker["customdata"][0]
    assert lines[0].endswith("(87.9% of capacity)")
    assert lines[1:4] == ["activations: 300.000 MiB (67%)", "parameters: 100.000 MiB (22%)",
                          "temporaries: 50.000 MiB (11%)"]  # fmt: skip
    # The allocating op, a name from the trace, is text: escaped for plotly's markup.
    assert lines[-1] == "  200.000 MiB activations (aten::&lt;a href='x'&gt;mm&lt;/a&gt;)"


def test_capacity_line_only_when_the_capacity_is_known() -> None:
    fig = memory_use_figure(SERIES, _peak(), capacity=None)
    assert fig is not None
    assert fig["layout"]["shapes"] == [] and fig["layout"]["updatemenus"] == []
    assert "range" not in fig["layout"]["yaxis"]  # plotly fits the stack
    assert not any(a["text"].startswith("capacity") for a in fig["layout"]["annotations"])
    # Without a peak the areas are still drawn, with no marker.
    bare = memory_use_figure(SERIES, None, capacity=None)
    assert bare is not None and {t["name"] for t in bare["data"]} == {
        "parameters",
        "activations",
        "temporaries",
    }
    assert memory_use_figure({"device": "cpu", "t_us": [], "categories": {}}, None) is None


def test_the_dominant_category_is_named_at_the_peak() -> None:
    sizes = {"parameters": 3 * GIB, "optimizer_state": 6 * GIB, "gradients": 3 * GIB}
    peak = _peak(
        at_us=1000.0,
        allocated=12 * GIB,
        bytes=sizes,
        shares={c: b / (12 * GIB) for c, b in sizes.items()},
        dominant="optimizer_state",
    )
    fig = memory_use_figure(SERIES, peak, capacity=80 * GIB)
    assert fig is not None
    assert fig["layout"]["yaxis"]["title"]["text"] == "GiB allocated"
    # The sample at the peak's instant is replaced by the report's bytes, not doubled.
    assert sum(len(t["x"]) for t in fig["data"] if t["name"] == "parameters") == 4
    assert _stack_at(fig, 1.0) == {"parameters": 3.0, "optimizer_state": 6.0, "gradients": 3.0,
                                   "activations": 0.0, "temporaries": 0.0}  # fmt: skip
    assert "peak 12.00 GiB: mostly optimizer_state (50%)" in [a["text"] for a in fig["layout"]["annotations"]]
    assert fig["layout"]["shapes"][0]["y0"] == 80.0
    # The whole device in view, and (12 of 80 GiB: a band at the bottom) a button to fit the stack.
    assert fig["layout"]["yaxis"]["range"] == [0, pytest.approx(80 * 1.08)]
    (menu,) = fig["layout"]["updatemenus"]
    fit = {b["label"]: b["args"][0]["yaxis.range"] for b in menu["buttons"]}
    assert fit == {"whole device": [0, pytest.approx(86.4)], "fit the stack": [0, pytest.approx(13.2)]}


def test_the_h100_loop_report_draws_its_gpu_stacked_to_its_peak() -> None:
    doc = contract.decode(pipeline.analyze_path(CUDA_MEMORY).to_dict())
    memory: MemorySection = doc.metrics.memory
    figs = memory_use_figures(memory)
    # The GPU, not the host's 8 bytes of scalars.
    assert list(figs) == ["memory_use_0"]
    fig = figs["memory_use_0"]
    assert fig["layout"]["title"]["text"] == "What holds the memory on cuda:0"
    (peak,) = [p for p in memory.by_category if p.device == "cuda:0"]
    at_peak = _stack_at(fig, peak.at_us / 1000.0)
    assert sum(at_peak.values()) == pytest.approx(peak.allocated / GIB)
    assert max(at_peak, key=at_peak.__getitem__) == peak.dominant == "activations"
    (capacity,) = [d["capacity"] for d in memory.devices if d["device"] == "cuda:0"]
    assert fig["layout"]["shapes"][0]["y0"] == pytest.approx(capacity / GIB)
    (marker,) = [t for t in fig["data"] if t["name"] == "peak"]
    assert any(block["op"] in line for block in peak.largest for line in marker["customdata"][0])


def test_trace_page_embeds_the_stacked_memory_view(client: TestClient, app: FastAPI, read_token: str) -> None:
    made = upload(client, CUDA_MEMORY.read_bytes(), run="memory").json()
    drain(app)
    with logged_in(app, read_token) as browser:
        html = browser.get(f"/traces/{made['id']}").text
    fig = page_plots(html)["plot-memory_use_0"]
    assert {t["name"] for t in fig["data"] if t.get("stackgroup")} >= {
        "parameters",
        "activations",
        "temporaries",
    }
    assert fig["layout"]["shapes"][0]["type"] == "line"


def test_a_real_cpu_loop_draws_its_activations_stacked_to_the_peak(tmp_path: Path) -> None:
    """A deep, narrow MLP on a large batch, recorded here with ``profile_memory=True``: its host
    stack is drawn with activations on top at the peak, adding up to the report's peak."""
    trace = cpu_loops.activation_heavy_loop(tmp_path / "act.json")
    memory = contract.decode(pipeline.analyze_path(trace).to_dict()).metrics.memory
    (peak,) = memory.by_category
    fig = memory_use_figures(memory)["memory_use_0"]
    at_peak = _stack_at(fig, peak.at_us / 1000.0)
    unit = {"MiB allocated": MIB, "GiB allocated": GIB}[fig["layout"]["yaxis"]["title"]["text"]]
    assert sum(at_peak.values()) == pytest.approx(peak.allocated / unit)
    assert max(at_peak, key=at_peak.__getitem__) == "activations"
    assert any("mostly activations" in a["text"] for a in fig["layout"]["annotations"])
    capacity = [d.get("capacity") for d in memory.devices if d.get("device") == peak.device]
    assert bool(fig["layout"]["shapes"]) == bool(capacity and capacity[0]), (
        capacity,
        fig["layout"]["shapes"],
    )
