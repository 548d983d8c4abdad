"""One trace's report on every surface: ``stepdoctor analyze FILE`` (JSON and text), the API and the
trace page show the same kind, share, step time, gain and first card, and every gain adds up
("up to N× (M less of S)": N = S / (S - M), the removable part capped where the gain is)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_analysis.cli import analyze as cli
from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_dashboard.formatting import duration
from support.fixtures import HTA_TRACES, TRACELENS_TRACES, TRACES
from support.server import drain, logged_in, upload

FIXTURES = [
    TRACES / "cuda" / "input.json.gz",
    HTA_TRACES / "amd_trace" / "mi250_minitoy_train_ROCm6_2_kineto.json.gz",  # a gain at the 20× cap
    HTA_TRACES / "cpu_only" / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz",
    TRACELENS_TRACES / "h100_gaunernst_bert-small-uncased__1016001.json.gz",
]


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name[:40])
def test_every_surface_shows_one_trace_report(
    path: Path, client: TestClient, app: FastAPI, read_token: str, capsys: pytest.CaptureFixture[str]
) -> None:
    report = analyze_path(path).to_dict()
    capsys.readouterr()
    assert cli.main([str(path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["primary"] == report["primary"]
    made = upload(client, path.read_bytes(), rank=None).json()
    drain(app)
    api = client.get(f"/api/v1/traces/{made['id']}").json()
    stored = api["analysis"]["report"]
    page = logged_in(app, read_token).get(f"/traces/{made['id']}").text

    p, step = stored["primary"], stored["step_time_us"]
    assert (p["kind"], p["share"], p["gain"]) == (
        report["primary"]["kind"],
        report["primary"]["share"],
        report["primary"]["gain"],
    )
    assert step == report["step_time_us"] and api["stale"] is False
    cards = stored["recommendations"]
    assert [c["id"] for c in cards[:1]] == [c["id"] for c in report["recommendations"][:1]]
    for card in cards:
        m = card["removable_us_per_step"]
        if card["basis"] != "single-pass" and m > 0:
            assert 0 < m < step
            assert card["expected_speedup"] == pytest.approx(step / (step - m), rel=2e-3, abs=2e-3)

    headline = re.search(r'<div class="headline">(.*?)</div>', page, re.S)
    assert headline is not None
    assert f">{p['kind']}<" in headline.group(1) and duration(step) in headline.group(1)
    assert page.count('id="verdict-note"') <= 1 and page.count('id="verdict"') == 1
    if cards:
        assert cards[0]["title"] in page
        if cards[0]["basis"] == "measured":
            assert f"up to {cards[0]['expected_speedup']:.2f}×" in page
            assert f"{duration(cards[0]['removable_us_per_step'])}</span> less of" in page
