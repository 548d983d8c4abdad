"""Verdict and first recommendation agree on the server too: API run diagnosis, run page, compare
API and compare page, for the input-bound ResNet50-like run, its fixed twin and a one-pass trace."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient

from support import verdict_traces as vt
from support.server import drain, logged_in, upload


def _verdict(page: str) -> str:
    return page.split('id="verdict"', 1)[1].split("</div>\n</div>", 1)[0]


def test_run_and_compare_pages_follow_the_limiter(
    client: TestClient, app: FastAPI, read_token: str, tmp_path: Path
) -> None:
    slow = upload(
        client, vt.resnet_input_bound(tmp_path / "w0.json.gz").read_bytes(), project="p", run="w0"
    ).json()
    fixed = vt.resnet_input_bound(tmp_path / "w4.json.gz", workers=4).read_bytes()
    fast = upload(client, fixed, project="p", run="w4").json()
    one = upload(client, vt.single_call(tmp_path / "one.json.gz").read_bytes(), project="p", run="one").json()
    drain(app)

    base = client.get(f"/api/v1/runs/{slow['run_id']}/diagnosis").json()["diagnosis"]
    assert base["primary"]["kind"] == "input"
    assert base["recommendations"][0]["id"] == "input.dataloader_workers"
    assert [r["primary_kind"] for r in base["ranks"]] == ["input"]  # per-rank verdicts use the same rule
    other = client.get(f"/api/v1/runs/{fast['run_id']}/diagnosis").json()["diagnosis"]
    assert other["primary"]["kind"] == "compute"
    assert other["recommendations"][0]["kind"] == "compute"
    cmp = client.get(f"/api/v1/compare?base={slow['run_id']}&other={fast['run_id']}").json()
    comparison = cmp.get("comparison", cmp)
    assert (comparison["primary"]["base"], comparison["primary"]["other"]) == ("input", "compute")

    with logged_in(app, read_token) as browser:
        page = browser.get(f"/runs/{slow['run_id']}").text
        verdict = _verdict(page)
        assert ">input</strong>" in verdict and "more DataLoader workers" in verdict
        assert ">compute</strong>" not in verdict
        compare_page = browser.get(f"/compare?base={slow['run_id']}&other={fast['run_id']}").text
        head = _verdict(compare_page)
        assert head.index('class="kind input"') < head.index('class="kind compute"')
        one_page = _verdict(browser.get(f"/runs/{one['run_id']}").text)
    # A one-pass trace: the note says why there is no next change; no per-step gain is offered.
    assert 'id="verdict-note"' in one_page and "one-time" in one_page
    assert "Change next" not in one_page
