"""TensorBoard export: the zip's layout, its bytes, and the real torch-tb-profiler plugin reading it."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from support.server import FIXTURE_TRACES, upload
from support.tensorboard import plugin_get, tensorboard_plugin, wait_for_run

TRACE_FILTER = FIXTURE_TRACES / "hta" / "trace_filter"
RANKS = {0: TRACE_FILTER / "sampled_rank-0.json.gz", 1: TRACE_FILTER / "sampled_rank-1.json.gz"}
PLUGIN = "/data/plugin/pytorch_profiler"


def _upload_run(client: TestClient, run: str = "tb-run") -> int:
    """Rank 0 with two capture windows, rank 1 with one."""
    run_id = 0
    for rank, window in ((0, 0), (1, 0), (0, 1)):
        meta = {"host": "gpu-node.example", "window": {"index": window, "first_step": window * 5}}
        resp = upload(client, RANKS[rank].read_bytes(), run=run, rank=rank, metadata=meta)
        assert resp.status_code == 201, resp.text
        run_id = int(resp.json()["run_id"])
    return run_id


def _zip(client: TestClient, run_id: int) -> zipfile.ZipFile:
    resp = client.get(f"/api/v1/runs/{run_id}/tensorboard.zip")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/zip"
    assert "attachment" in resp.headers["content-disposition"]
    return zipfile.ZipFile(io.BytesIO(resp.content))


def test_zip_has_one_file_per_rank_and_window(client: TestClient) -> None:
    consts = pytest.importorskip("torch_tb_profiler.consts")
    run_id = _upload_run(client)
    with _zip(client, run_id) as zf:
        names = sorted(zf.namelist())
        assert len(names) == 3
        workers: dict[str, list[str]] = {}
        for name in names:
            run_dir, file_name = name.split("/")
            assert run_dir == "tb-run"
            m = consts.WORKER_PATTERN.match(file_name)
            assert m is not None and m.group(2) is not None, name
            workers.setdefault(m.group(1), []).append(m.group(2))
            rank = int(consts.NODE_PROCESS_PATTERN.match(m.group(1)).group(2))
            assert zf.read(name) == RANKS[rank].read_bytes()  # the uploaded bytes, untouched
        assert {w: len(spans) for w, spans in workers.items()} == {
            "gpu-node-example_0": 2,
            "gpu-node-example_1": 1,
        }


def test_zip_errors(client: TestClient, read_token: str) -> None:
    assert client.get("/api/v1/runs/999999/tensorboard.zip").status_code == 404
    assert (
        client.get("/api/v1/runs/1/tensorboard.zip", headers={"Authorization": "Bearer nope"}).status_code
        == 401
    )
    run_id = _upload_run(client, run="readable")
    resp = client.get(
        f"/api/v1/runs/{run_id}/tensorboard.zip", headers={"Authorization": f"Bearer {read_token}"}
    )
    assert resp.status_code == 200


@pytest.mark.slow
@pytest.mark.only_db("sqlite")  # the export does not depend on the database backend
def test_tensorboard_plugin_loads_the_export(
    client: TestClient, tmp_path: Path, server_settings: Any, db_url: str
) -> None:
    pytest.importorskip("torch_tb_profiler")
    run_id = _upload_run(client)
    logdir = tmp_path / "logdir"
    with _zip(client, run_id) as zf:
        zf.extractall(logdir)

    log_path = tmp_path / "tensorboard.log"
    with tensorboard_plugin(logdir, log_path) as base:
        wait_for_run(base, "tb-run", log_path)
        views = plugin_get(base, "/views", run="tb-run")
        assert "Overview" in views and "Distributed" in views
        workers = plugin_get(base, "/workers", run="tb-run", view="Overview")
        assert workers == ["gpu-node-example_0", "gpu-node-example_1"]
        assert plugin_get(base, "/spans", run="tb-run", worker="gpu-node-example_0") == ["1", "2"]
        overview = plugin_get(base, "/overview", run="tb-run", worker="gpu-node-example_0", span="2")
        assert overview["steps"]["rows"], overview.keys()
        assert {"title": "Number of Worker(s)", "value": "2"} in overview["environments"]
