"""One run verdict on every surface: ``stepdoctor analyze DIR`` (text and JSON), the run diagnosis API
and the run page show the same kind, share, step time, gain and first card for the same traces, and
their numbers add up ("up to N× (M less of S)" has N = S / (S - M)). Windows are never ranks: a run
of one process's capture windows names no straggler and draws no rank chart.

Fixtures: HTA's two ranks, two TraceLens traces of one (unknown) worker, a kineto-style directory of
two capture windows, a recorded CPU run with repeat=3, and a synthetic 8-rank all-to-all job.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import socket
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_analysis.cli import analyze as cli
from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_dashboard.formatting import duration
from support import cpu_loops
from support import synthetic_dist as sd
from support.fixtures import HTA_TRACES, TRACELENS_TRACES, TRACES
from support.server import drain, logged_in, upload


def _hta_ranks(d: Path) -> None:
    for f in sorted((HTA_TRACES / "trace_filter").glob("*.json.gz")):
        shutil.copy(f, d / f.name)


def _tracelens_pair(d: Path) -> None:
    for n in ("h100_gaunernst_bert-small-uncased__1016001", "mi300_gaunernst_bert-small-uncased__1016001"):
        shutil.copy(TRACELENS_TRACES / f"{n}.json.gz", d / f"{n}.json.gz")


def _kineto_windows(d: Path) -> None:
    shutil.copy(TRACES / "cuda" / "input.json.gz", d / "host_77.1.pt.trace.json.gz")
    shutil.copy(TRACES / "cuda" / "input.after.json.gz", d / "host_77.2.pt.trace.json.gz")


def _cpu_repeat3(d: Path) -> None:
    cpu_loops.compute_bound_windows(d, repeat=3)


def _all_to_all_8(d: Path) -> None:
    for r in range(8):
        sd.all_to_all_trace(d / f"rank{r}.json", rank=r, world_size=8)


# name -> (builder, windows only: one process)
JOBS = {
    "hta_ranks": (_hta_ranks, False),
    "tracelens_pair": (_tracelens_pair, True),
    "kineto_windows": (_kineto_windows, True),
    "cpu_repeat3": (_cpu_repeat3, True),
    "all_to_all_8": (_all_to_all_8, False),
}


def _cli(path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """``stepdoctor analyze PATH ARGS``: its standard output."""
    capsys.readouterr()
    assert cli.main([str(path), *args]) == 0
    return capsys.readouterr().out


def _upload_job(client: TestClient, directory: Path, run: str) -> int:
    """Every trace of the job, as the agent uploads it: one process (same host and pid) per rank."""
    first = 0
    for i, f in enumerate(sorted(directory.iterdir())):
        body = f.read_bytes() if f.name.endswith(".gz") else gzip.compress(f.read_bytes())
        meta = {"host": socket.gethostname(), "pid": 4242, "window": {"index": i}}
        resp = upload(client, body, run=run, rank=None, metadata=meta)
        assert resp.status_code == 201, resp.text
        first = first or int(resp.json()["id"])
    return first


def _adds_up(gain: float, removable_us: float, step_us: float) -> None:
    """ "up to N× (M less of S)": N = S / (S - M), within the rounding of the shown figures."""
    assert step_us > 0 and 0 <= removable_us < step_us
    assert gain == pytest.approx(step_us / (step_us - removable_us), rel=2e-3, abs=2e-3)


@pytest.mark.parametrize("name", list(JOBS))
def test_every_surface_shows_one_run_verdict(
    name: str,
    tmp_path: Path,
    client: TestClient,
    app: FastAPI,
    read_token: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    build, windows_only = JOBS[name]
    job = tmp_path / name
    job.mkdir()
    build(job)

    report = analyze_path(job).to_dict()
    text = _cli(job, capsys)
    as_json = json.loads(_cli(job, capsys, "--format", "json"))
    first = _upload_job(client, job, name)
    drain(app)
    run_id = client.get(f"/api/v1/traces/{first}").json()["run_id"]
    api = client.get(f"/api/v1/runs/{run_id}/diagnosis").json()["diagnosis"]
    page = logged_in(app, read_token).get(f"/runs/{run_id}").text

    # CLI JSON is the pipeline's report; the API holds the run verdict of the same traces.
    assert as_json["primary"] == report["primary"]
    p, rec = api["primary"], (api["recommendations"] or [None])[0]
    assert report["primary"]["kind"] == p["kind"]
    assert report["primary"]["share"] == pytest.approx(p["share"], abs=1e-4)
    assert report["primary"]["gain"] == pytest.approx(p["gain"], abs=1e-3)
    assert report["step_time_us"] == pytest.approx(api["step_time_us"], abs=1e-3)
    cli_first = (report["recommendations"] or [None])[0]
    assert (cli_first or {}).get("id") == (rec or {}).get("id")
    if rec is not None and cli_first is not None:
        assert cli_first["expected_speedup"] == pytest.approx(rec["expected_speedup"], abs=1e-3)
        assert cli_first["removable_us_per_step"] == pytest.approx(rec["removable_us_per_step"], abs=1e-3)

    # Numbers that add up, for the verdict and every card, over one time-weighted aggregate.
    step = api["step_time_us"]
    _adds_up(p["gain"], p["removable_us_per_step"], step)
    for card in api["recommendations"]:
        _adds_up(card["expected_speedup"], card["removable_us_per_step"], step)
    assert p["us_per_step"] == pytest.approx(p["share"] * step, rel=1e-3)
    assert sum(api["kinds_us"].values()) == pytest.approx(step, rel=0.02)
    assert sum(api["breakdown"].values()) == pytest.approx(step, rel=0.02)
    # The headline share is the limiter's share of the step; the gain line labels its removable part.
    assert p["share"] == pytest.approx(api["shares"][p["kind"]], abs=1e-6)

    # CLI text: the same kind, share, step time and first card.
    shown = report["primary"]["share"]  # the API's, rounded to 4 places (asserted above)
    assert f"Primary bottleneck: {p['kind'].upper()} — {100 * shown:.0f}% of step wall time" in text
    assert f"mean step {_fmt(step)}" in text
    if rec is not None:
        assert f"Next optimization: {rec['title']}" in text
        assert "  Seen in a trace: " in text  # a trace's words, labelled so, not the run's share

    # Run page: the same kind, share, step, gain and first card; the verdict note at most once.
    headline = re.search(r'<div class="headline">(.*?)</div>', page, re.S)
    assert headline is not None
    assert f">{p['kind']}<" in headline.group(1) and f"{100 * p['share']:.0f}%" in headline.group(1)
    assert duration(step) in headline.group(1)
    if p["gain"] > 1.02:
        assert f"{p['gain']:.2f}×" in page
    if rec is not None:
        assert rec["title"] in page and f"{rec['expected_speedup']:.2f}×" in page
        # The card's own words come from a trace: labelled so, not read as the run's share.
        assert 'class="muted why-scope"' in page
    assert page.count('id="verdict-note"') <= 1 and page.count('id="verdict"') == 1
    # The run's details (device, tables) come from the trace that stands for its verdict.
    assert api["lead_trace_id"] is not None
    assert f'href="/traces/{api["lead_trace_id"]}">trace #{api["lead_trace_id"]}</a>' in page or (
        'id="kernels"' not in page and 'id="collectives' not in page
    )

    # Windows are never ranks.
    if windows_only:
        assert report["ranks"]["count"] == len(api["ranks"]) == 1
        assert report["ranks"]["stragglers"] == [] and api["stragglers"] == []
        assert "rank None" not in page and 'id="stragglers"' not in page and "plot-ranks" not in page
        assert not any(c["id"] == "communication.straggler" for c in api["recommendations"])
    else:
        assert report["ranks"]["count"] == len(api["ranks"]) > 1
        assert report["ranks"]["stragglers"] == [s["rank"] for s in api["stragglers"]]


def _fmt(us: float) -> str:
    """The dashboard's duration filter and the CLI's ``_fmt_us`` agree on these ranges."""
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs"
