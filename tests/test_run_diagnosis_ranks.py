"""The server's run diagnosis and ``stepdoctor analyze DIR`` agree on ranks, windows, stragglers and
the verdict for the same traces: uploaded through the API, analysed by the worker code, read back
from the run endpoint (SQLite and PostgreSQL, like the other server tests)."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_analysis.pipeline import analyze_path
from support import synthetic_dist as sd
from support.server import drain, upload


def _upload_dir(client: TestClient, directory: Path, run: str, *, rank_from_upload: bool) -> int:
    ids = []
    for i, f in enumerate(sorted(directory.iterdir())):
        body = gzip.compress(f.read_bytes())
        rank = int(f.stem.removeprefix("rank")) if rank_from_upload else None
        meta = {"host": "node1", "window": {"index": i if not rank_from_upload else 0}}
        resp = upload(client, body, run=run, rank=rank, metadata=meta)
        assert resp.status_code == 201, resp.text
        ids.append(int(resp.json()["id"]))
    return ids[0]


def _run_diagnosis(client: TestClient, app: FastAPI, first_trace: int) -> dict[str, Any]:
    drain(app)
    run_id = client.get(f"/api/v1/traces/{first_trace}").json()["run_id"]
    diag: dict[str, Any] = client.get(f"/api/v1/runs/{run_id}").json()["diagnosis"]
    return diag


def test_server_and_cli_agree_on_a_straggler_job(client: TestClient, app: FastAPI, tmp_path: Path) -> None:
    job = sd.straggler_job(tmp_path / "job", ranks=3, slow_rank=2)
    cli = analyze_path(job).to_dict()
    # Ranks come from the upload for two of them and from distributedInfo for the third.
    server = _run_diagnosis(client, app, _upload_dir(client, job, "straggler", rank_from_upload=True))
    assert cli["ranks"]["stragglers"] == [s["rank"] for s in server["stragglers"]] == [2]
    assert cli["ranks"]["straggler_details"][0]["cause"] == server["stragglers"][0]["cause"] == "compute"
    assert cli["ranks"]["count"] == len(server["ranks"]) == 3
    assert cli["primary"]["kind"] == server["primary"]["kind"]
    assert cli["recommendations"][0]["id"] == server["recommendations"][0]["id"] == "communication.straggler"


def test_windows_without_upload_rank_use_distributed_info(
    client: TestClient, app: FastAPI, tmp_path: Path
) -> None:
    job = tmp_path / "job"
    job.mkdir()
    sd.all_to_all_trace(job / "rank0_a.json", rank=0, world_size=2)
    sd.all_to_all_trace(job / "rank0_b.json", rank=0, world_size=2)
    cli = analyze_path(job).to_dict()
    server = _run_diagnosis(client, app, _upload_dir(client, job, "windows", rank_from_upload=False))
    assert cli["ranks"]["count"] == len(server["ranks"]) == 1
    assert server["ranks"][0]["rank"] == 0 and server["ranks"][0]["traces"] == 2
    assert cli["ranks"]["stragglers"] == [] and server["stragglers"] == []
    assert cli["primary"]["kind"] == server["primary"]["kind"] == "communication"
    assert server["recommendations"][0]["id"] == "communication.all_to_all"


def test_workload_tag_from_the_agent_reaches_the_analysis(
    client: TestClient, app: FastAPI, tmp_path: Path
) -> None:
    trace = sd.all_to_all_trace(tmp_path / "t.json")  # has backward ops: training by the trace alone
    meta = {"host": "node1", "window": {"index": 0}, "tags": {"workload": "inference"}}
    resp = upload(client, gzip.compress(trace.read_bytes()), run="tagged", metadata=meta)
    assert resp.status_code == 201, resp.text
    drain(app)
    report = client.get(f"/api/v1/traces/{resp.json()['id']}").json()["analysis"]["report"]
    assert report["workload"]["kind"] == "inference" and report["workload"]["source"] == "metadata"
    assert not any(r["id"] == "communication.overlap" for r in report["findings"])
