"""The dashboard's figures as the pages embed them, from real engine output: the rank chart marks
the stragglers the verdict names on the metric they were judged by, the memory plot carries each
device's capacity, and the drawn step's lanes read as threads ("main thread"), not raw ids."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_dashboard.figures import lane_titles
from support import synthetic
from support.dashboard import page_plots
from support.fixtures import HTA_TRACES
from support.server import drain, logged_in, upload
from support.synthetic_dist import straggler_job

GIB = 2**30
STRAGGLER_RED = "#e45756"


def test_rank_chart_marks_the_stragglers_on_the_metric_they_were_judged_by(
    client: TestClient, app: FastAPI, read_token: str, tmp_path: Path
) -> None:
    job = straggler_job(tmp_path / "job", ranks=4, slow_rank=2, extra=0.5)
    made = {}
    for rank in range(4):
        made = upload(
            client, (job / f"rank{rank}.json").read_bytes(), run="ddp", rank=rank, gzipped=False
        ).json()
    drain(app)
    diagnosis = client.get(f"/api/v1/runs/{made['run_id']}").json()["diagnosis"]
    assert [s["rank"] for s in diagnosis["stragglers"]] == [2]
    basis = diagnosis["rank_spread"]["basis"]
    assert basis == "busy time before collectives"
    with logged_in(app, read_token) as browser:
        chart = page_plots(browser.get(f"/runs/{made['run_id']}").text)["plot-ranks"]
    (bar,) = chart["data"]
    by_rank = {r["rank"]: r for r in diagnosis["ranks"]}
    # The bars are the busy time the stragglers were judged on, not the (equal) step times.
    assert bar["y"] == pytest.approx([by_rank[int(x)]["busy_us"] / 1000 for x in bar["x"]])
    assert max(bar["y"]) > 1.3 * min(bar["y"])
    assert basis in chart["layout"]["yaxis"]["title"]["text"]
    colours = dict(zip(bar["x"], bar["marker"]["color"], strict=True))
    assert colours["2"] == STRAGGLER_RED and {colours[r] for r in ("0", "1", "3")} == {"#4c78a8"}
    (note,) = chart["layout"]["annotations"]
    assert note["x"] == "2" and f"{diagnosis['stragglers'][0]['over_median']:.2f}×" in note["text"]
    (median,) = chart["layout"]["shapes"]
    assert median["y0"] == pytest.approx(diagnosis["rank_spread"]["median_busy_us"] / 1000)


def test_memory_plot_draws_the_device_capacity(
    client: TestClient, app: FastAPI, read_token: str, tmp_path: Path
) -> None:
    path = synthetic.memory_trace(
        tmp_path / "mem.json", params=2 * GIB, grads=2 * GIB, state=4 * GIB, activations=8 * GIB
    )
    made = upload(client, path.read_bytes(), gzipped=False).json()
    drain(app)
    report = client.get(f"/api/v1/traces/{made['id']}").json()["analysis"]["report"]
    (device,) = report["metrics"]["memory"]["devices"]
    with logged_in(app, read_token) as browser:
        chart = page_plots(browser.get(f"/traces/{made['id']}").text)["plot-memory"]
    lines = [t for t in chart["data"] if "capacity" in t["name"]]
    assert len(lines) == 1
    assert lines[0]["name"] == "cuda:0 capacity (80.0 GiB)"
    assert set(lines[0]["y"]) == {device["capacity"] / 2**20}
    curves = [t for t in chart["data"] if "capacity" not in t["name"]]
    assert curves and max(max(c["y"]) for c in curves) < lines[0]["y"][0]


def test_step_lanes_are_named_as_threads(
    client: TestClient, app: FastAPI, read_token: str, tmp_path: Path
) -> None:
    path = synthetic.exposed_nccl_trace(tmp_path / "nccl.json")
    made = upload(client, path.read_bytes(), gzipped=False).json()
    drain(app)
    report = client.get(f"/api/v1/traces/{made['id']}").json()["analysis"]["report"]
    raw = [lane["label"] for lane in report["timeline"]["steps"][0]["lanes"]]
    assert any(label.startswith("host thread ") for label in raw)
    with logged_in(app, read_token) as browser:
        chart = page_plots(browser.get(f"/traces/{made['id']}").text)["plot-step"]
    rows = chart["layout"]["yaxis"]["categoryarray"]
    assert "main thread" in rows
    assert not any(row.startswith("host thread") for row in rows)
    assert any(row.startswith("GPU 0 stream") for row in rows)


def test_lane_titles_name_the_main_backward_and_loader_threads() -> None:
    """On a real HTA trace the autograd engine's thread is the backward thread; loader-only lanes
    are DataLoader workers; lanes of several processes say which; GPU lanes keep their labels."""
    report = analyze_path(HTA_TRACES / "trace_filter" / "sampled_rank-0.json.gz").to_dict()
    timeline = report["timeline"]
    lanes = timeline["steps"][0]["lanes"]
    titles = lane_titles(lanes, timeline["names"])
    assert [lane["label"] for lane in lanes][:2] == ["host thread 4037", "host thread 23695"]
    assert titles[:3] == ["main thread", "backward thread", "GPU 0 stream 7"]
    names = ["aten::mm", "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", "aten::pin_memory"]

    def host(label: str, *ops: int) -> dict[str, object]:
        return {"label": label, "kind": "host", "boxes": [[0, 1, op, 1] for op in ops]}

    made = [host("host 10/-3", 0, 1), host("host 10/7", 2, 2), host("host 11/-3", 0), host("host 11/8", 2)]
    assert lane_titles(made, names) == [
        "main thread (process 10)",
        "DataLoader worker (process 10)",
        "main thread (process 11)",
        "DataLoader worker (process 11)",
    ]
    assert lane_titles([host("host thread -3", 0), host("host thread 5", 0)], names) == [
        "main thread",
        "thread 2",
    ]


def test_step_boxes_hover_with_their_length_not_their_end() -> None:
    """Plotly's ``%{x}`` on a bar drawn from a base is the bar's end; the hover must read the length."""
    from stepdoctor_dashboard.figures import step_figure

    step = {
        "lanes": [
            {"kind": "host", "label": "host thread 1", "boxes": [[165.0, 195.0, 0, 1]]},
            {"kind": "charged", "label": "charged", "boxes": [[165.0, 195.0, "compute"]]},
        ]
    }
    data = step_figure(step, ["aten::mm"])["data"]
    for trace in data:
        template = trace["hovertemplate"]
        assert "%{x" not in template, template
        lengths = [c[2] if isinstance(c, list) else c for c in trace["customdata"]]
        assert lengths == pytest.approx([0.03]), trace  # 30 µs, shown where the old hover said 0.195 ms
