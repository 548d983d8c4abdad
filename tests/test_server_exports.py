"""TensorBoard export: the zip's layout, its bytes, and the real torch-tb-profiler plugin reading it."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from support.server import FIXTURE_TRACES, upload

TRACE_FILTER = FIXTURE_TRACES / "hta" / "trace_filter"
RANKS = {0: TRACE_FILTER / "sampled_rank-0.json.gz", 1: TRACE_FILTER / "sampled_rank-1.json.gz"}
PLUGIN = "/data/plugin/pytorch_profiler"


def _upload_run(client: TestClient, run: str = "tb-run") -> int:
    """Rank 0 with two capture windows, rank 1 with one."""
    if not RANKS[0].is_file():
        pytest.skip(f"shared trace fixtures missing: {TRACE_FILTER}")
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str, **params: Any) -> Any:
    resp = httpx.get(url, params=params, timeout=10)
    assert resp.status_code == 200, f"{url} {params}: {resp.status_code} {resp.text[:300]}"
    return resp.json()


@pytest.mark.slow
def test_tensorboard_plugin_loads_the_export(
    client: TestClient, tmp_path: Path, server_settings: Any, db_url: str
) -> None:
    if "sqlite" not in db_url:
        pytest.skip("the export does not depend on the database backend; checked once on SQLite")
    pytest.importorskip("torch_tb_profiler")
    run_id = _upload_run(client)
    logdir = tmp_path / "logdir"
    with _zip(client, run_id) as zf:
        zf.extractall(logdir)

    port = _free_port()
    log_path = tmp_path / "tensorboard.log"
    tensorboard = Path(sys.executable).with_name("tensorboard")
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(tensorboard), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        )
    base = f"http://127.0.0.1:{port}{PLUGIN}"
    try:
        deadline = time.monotonic() + 90
        runs: Any = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text(errors="replace")
            try:
                runs = httpx.get(f"{base}/runs", timeout=2).json()
                if "tb-run" in runs["runs"] and not runs["loading"]:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        assert runs and "tb-run" in runs["runs"], (
            f"plugin never listed the run: {runs}\n{log_path.read_text()}"
        )

        views = _get(f"{base}/views", run="tb-run")
        assert "Overview" in views and "Distributed" in views
        workers = _get(f"{base}/workers", run="tb-run", view="Overview")
        assert workers == ["gpu-node-example_0", "gpu-node-example_1"]
        assert _get(f"{base}/spans", run="tb-run", worker="gpu-node-example_0") == ["1", "2"]
        overview = _get(f"{base}/overview", run="tb-run", worker="gpu-node-example_0", span="2")
        assert overview["steps"]["rows"], overview.keys()
        assert {"title": "Number of Worker(s)", "value": "2"} in overview["environments"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
