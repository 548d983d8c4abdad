"""The step series reaches a real ``stepdoctor serve``: shipped by the agent's delivery thread while
a real CPU loop trains, and by ``stepdoctor sync`` after an offline run. Every step arrives, once,
and the server's run timeline is the engine's over the same chunks."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import httpx
import pytest

from stepdoctor.series import SUFFIX, SeriesSettings
from stepdoctor.spool import UPLOADED_DIR
from stepdoctor_analysis.run import timeline as rt
from support.series_loops import run_loop
from support.server import cli_token, migrated_sqlite_env, serve_subprocess

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _agent_errors_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("STEPDOCTOR_SERVER", "STEPDOCTOR_TOKEN", "STEPDOCTOR_SERIES", "STEPDOCTOR_SPOOL_MAX_BYTES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("STEPDOCTOR_RAISE_ERRORS", "1")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    env = migrated_sqlite_env(tmp_path_factory.mktemp("series-server"))
    with serve_subprocess(env) as served:
        yield {"url": served.url, "upload": cli_token(env, "upload"), "read": cli_token(env, "read")}


def run_api(server: dict[str, str], run: str) -> dict[str, Any]:
    with httpx.Client(base_url=server["url"], headers={"Authorization": f"Bearer {server['read']}"}) as api:
        runs = api.get("/api/v1/runs", params={"project": "proj"}).json()["items"]
        (found,) = [r for r in runs if r["name"] == run]
        detail = api.get(f"/api/v1/runs/{found['id']}")
        assert detail.status_code == 200, detail.text
        body: dict[str, Any] = detail.json()
        assert body["liveness"] == found["liveness"]  # the list and the run say the same
        return body


def test_the_agent_ships_every_step_to_the_server_while_training(
    tmp_path: Path, server: dict[str, str]
) -> None:
    settings = SeriesSettings(chunk_steps=40, anomaly_capture=False)
    prof = run_loop(
        tmp_path, "online", 130, series_settings=settings, server=server["url"], token=server["upload"]
    )
    assert prof.captured == 1
    run_dir = tmp_path / "proj" / "online"
    assert not list(run_dir.glob(f"*{SUFFIX}"))  # every chunk delivered, none left to send
    copies = tmp_path / UPLOADED_DIR / "proj" / "online"
    local = rt.read_run_timeline(copies)
    assert local is not None and (local.steps, local.missing_steps, local.finished) == (130, 0, True)
    body = run_api(server, "online")
    assert body["run_timeline"] == local.to_dict()
    # the same numbers as `stepdoctor analyze RUN_DIR --format json` over the local copies
    from stepdoctor_analysis.cli import analyze as cli

    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main([str(copies), "--format", "json"]) == 0
    assert json.loads(out.getvalue())["run_timeline"] == body["run_timeline"]
    assert body["liveness"] == "finished"
    assert len(body["run_timeline"]["windows"]) == 1 and body["trace_status"]


def test_sync_ships_an_offline_runs_series_once(tmp_path: Path, server: dict[str, str]) -> None:
    from stepdoctor import sync

    settings = SeriesSettings(chunk_steps=25, anomaly_capture=False)
    run_loop(tmp_path, "offline", 90, series_settings=settings)
    run_dir = tmp_path / "proj" / "offline"
    sent = sorted(run_dir.glob(f"*{SUFFIX}"))
    assert len(sent) >= 4
    args = [
        "--spool",
        str(tmp_path),
        "--server",
        server["url"],
        "--token",
        server["upload"],
        "--timeout",
        "60",
    ]
    assert sync.main(args) == 0
    assert not list(run_dir.glob(f"*{SUFFIX}"))
    expected = rt.run_timeline(
        p.read_bytes() for p in sorted((tmp_path / UPLOADED_DIR / "proj" / "offline").glob(f"*{SUFFIX}"))
    )
    body = run_api(server, "offline")
    assert body["run_timeline"] == expected.to_dict() and body["run_timeline"]["steps"] == 90
    # a chunk sent again (an answer lost on the way back) is stored once: same timeline, no refusal
    copy = tmp_path / UPLOADED_DIR / "proj" / "offline" / sent[1].name
    shutil.copy(copy, run_dir / sent[1].name)
    assert sync.main(args) == 0
    assert run_api(server, "offline")["run_timeline"] == expected.to_dict()
