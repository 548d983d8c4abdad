"""One run leak on every surface: a run whose leak shows only through the agent's step series (two
2-step capture windows: too few for the windows) gets the same ``memory.leak`` finding from
``stepdoctor analyze RUN_DIR`` and from the server's run diagnosis, which reads the stored series
(``runs.diagnosis_job.refresh_run_diagnosis``); a series arriving after the traces were analysed
makes the diagnosis due again (the workers' sweep ``recheck_series_diagnoses`` redoes it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_analysis.cli import analyze as cli
from stepdoctor_server.jobs.defer import SWEEPS
from stepdoctor_server.runs.diagnosis_job import recheck_series_diagnoses_now
from support import cpu_loops
from support.server import bearer, drain, upload


def _leak(findings: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((f for f in findings if f["id"] == "memory.leak"), None)


def test_a_leak_seen_only_through_the_step_series_is_the_same_offline_and_on_the_server(
    tmp_path: Path,
    client: TestClient,
    app: FastAPI,
    upload_token: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_dir = cpu_loops.host_memory_run(tmp_path / "spool", keep=True, windows=2)
    traces = sorted(run_dir.glob("*.pt.trace.json.gz"))
    chunks = sorted(run_dir.glob("*.stepdoctor.series"))
    assert len(traces) == 2 and chunks

    capsys.readouterr()
    assert cli.main([str(run_dir), "--format", "json"]) == 0
    offline = _leak(json.loads(capsys.readouterr().out)["findings"])
    assert offline is not None and offline["evidence"]["basis"].startswith("the agent's step series")

    # The traces first, analysed and diagnosed without a series; then the series arrives.
    first = 0
    for t in traces:
        meta = json.loads(
            t.with_name(t.name.removesuffix(".pt.trace.json.gz") + ".stepdoctor.meta").read_text()
        )
        resp = upload(
            client, t.read_bytes(), token=upload_token, run="leak", rank=None, metadata=meta["metadata"]
        )
        assert resp.status_code == 201, resp.text
        first = first or int(resp.json()["id"])
    drain(app)
    run_id = client.get(f"/api/v1/traces/{first}").json()["run_id"]
    before = client.get(f"/api/v1/runs/{run_id}/diagnosis").json()["diagnosis"]
    assert _leak(before["findings"]) is None  # two 2-step windows cannot show it
    for c in chunks:
        resp = client.post(
            "/api/v1/series",
            params={"project": "proj", "run": "leak"},
            content=c.read_bytes(),
            headers={**bearer(upload_token), "Content-Type": "application/octet-stream"},
        )
        assert resp.status_code == 201, resp.text
        assert resp.json()["run_id"] == run_id
    assert recheck_series_diagnoses_now in SWEEPS
    assert recheck_series_diagnoses_now(app.state.db) == [run_id]
    online = _leak(client.get(f"/api/v1/runs/{run_id}/diagnosis").json()["diagnosis"]["findings"])
    assert online is not None
    assert online["evidence"] == offline["evidence"]
    shared = set(online) & set(offline)
    assert {"why", "title", "evidence"} <= shared
    assert {k: online[k] for k in shared} == {k: offline[k] for k in shared}
    assert recheck_series_diagnoses_now(app.state.db) == []  # nothing new: nothing redone
