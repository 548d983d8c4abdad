"""An Accelerate loop on CPU profiled by ``StepdoctorAccelerate``, delivered to a real server
(``stepdoctor serve`` with an analysis worker), and the verdict of each analysed window logged
into the W&B (offline) or MLflow (file store) run active in the training process."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from support.server import ServerProcess, cli_token, migrated_sqlite_env, serve_subprocess
from support.wandb_offline import summary, summary_updates

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
accelerate = pytest.importorskip("accelerate")

SCHEDULE = {"skip_first": 1, "warmup": 1, "active": 2, "repeat": 2}  # windows: steps 2-3 and 5-6
ANALYSIS_TIMEOUT_S = 300.0  # two tiny traces on a busy 2-core machine


@pytest.fixture(autouse=True)
def _agent_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPDOCTOR_RAISE_ERRORS", "1")
    for var in (
        "STEPDOCTOR_SERVER",
        "STEPDOCTOR_TOKEN",
        "STEPDOCTOR_SPOOL",
        "STEPDOCTOR_RUN",
        "RANK",
        "WORLD_SIZE",
    ):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def server_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return migrated_sqlite_env(tmp_path_factory.mktemp("data")) | {"STEPDOCTOR_WORKERS": "1"}


@pytest.fixture(scope="module")
def server(server_env: dict[str, str]) -> Iterator[tuple[ServerProcess, str]]:
    """A real server with one analysis worker, and an admin token of its default team."""
    with serve_subprocess(server_env, timeout_s=120) as process:
        yield process, cli_token(server_env, "admin")


@pytest.fixture
def upload_only(server: tuple[ServerProcess, str], server_env: dict[str, str]) -> str:
    return cli_token(server_env, "upload")


def _get(server: tuple[ServerProcess, str], path: str) -> Any:
    request = urllib.request.Request(
        f"{server[0].url}/api/v1{path}", headers={"Authorization": f"Bearer {server[1]}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _train(server: tuple[ServerProcess, str], spool: Path, project: str, run: str, **options: Any) -> Any:
    """Eight optimizer steps of two accumulated micro-batches each, under ``StepdoctorAccelerate``."""
    from accelerate import Accelerator

    from stepdoctor.integrations.accelerate import StepdoctorAccelerate

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))
    options = {"server": server[0].url, "token": server[1], "spool": spool, **SCHEDULE, **options}
    with StepdoctorAccelerate(accelerator, project, run, **options) as sd:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    return sd


def _run(server: tuple[ServerProcess, str], project: str, name: str) -> dict[str, Any]:
    runs = _get(server, f"/runs?project={project}")["items"]
    (run,) = [r for r in runs if r["name"] == name]
    return dict(run)


def _analysed(server: tuple[ServerProcess, str], run_id: int, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + ANALYSIS_TIMEOUT_S
    while True:
        traces = _get(server, f"/runs/{run_id}/traces")["items"]
        if sum(t["status"] == "done" for t in traces) >= count or time.monotonic() > deadline:
            return sorted(traces, key=lambda t: t["first_step"])
        time.sleep(1.0)


def test_accelerate_loop_lands_in_a_run_with_its_steps(
    server: tuple[ServerProcess, str], tmp_path: Path
) -> None:
    sd = _train(server, tmp_path / "spool", "acc", "loop")
    assert sd.prof is None and sd.session.reporter is None  # stopped; no tracker was active
    run = _run(server, "acc", "loop")
    traces = _analysed(server, run["id"], 2)
    assert [(t["first_step"], t["last_step"]) for t in traces] == [(2, 3), (5, 6)]
    assert all(t["status"] == "done" for t in traces), traces
    report = _get(server, f"/traces/{traces[0]['id']}/report")["report"]
    assert [s["number"] for s in report["steps"]] == [2, 3]
    meta = _get(server, f"/traces/{traces[0]['id']}")["metadata"]
    assert meta["framework"]["name"] == "accelerate" and meta["framework"]["gradient_accumulation_steps"] == 2
    assert meta["loader"]["batch_size"] == 4


def _expected(
    server: tuple[ServerProcess, str], project: str, name: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    run = _run(server, project, name)
    return run, _get(server, f"/runs/{run['id']}/diagnosis")["diagnosis"]


def test_verdict_lands_in_an_offline_wandb_run(
    server: tuple[ServerProcess, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    wb = wandb.init(project="stepdoctor-test", dir=str(tmp_path))
    try:
        _train(server, tmp_path / "spool", "wb", "loop", tracker_timeout=ANALYSIS_TIMEOUT_S)
    finally:
        wb.finish()
    run, diagnosis = _expected(server, "wb", "loop")
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    got = summary(run_dir)
    assert got["stepdoctor/verdict"] == diagnosis["primary"]["kind"]
    assert got["stepdoctor/share"] == pytest.approx(diagnosis["primary"]["share"])
    assert got["stepdoctor/gain"] == pytest.approx(diagnosis["primary"]["gain"])
    cards = diagnosis["recommendations"]
    assert got.get("stepdoctor/first_card") == (cards[0]["title"] if cards else None)
    assert got["stepdoctor/run_page"] == f"{server[0].url}/runs/{run['id']}"
    assert got["stepdoctor/steps"] == 4 and got["stepdoctor/step_time_ms_p50"] > 0
    assert (
        got["stepdoctor/step_time_ms_max"]
        >= got["stepdoctor/step_time_ms_p90"]
        >= got["stepdoctor/step_time_ms_p50"]
    )
    assert summary_updates(run_dir, "stepdoctor/windows") == [1, 2]  # once per analysed window


def test_verdict_lands_in_a_file_store_mlflow_run(
    server: tuple[ServerProcess, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    try:
        with mlflow.start_run() as active:
            _train(server, tmp_path / "spool", "ml", "loop", tracker_timeout=ANALYSIS_TIMEOUT_S)
        data = MlflowClient().get_run(active.info.run_id).data
        windows = MlflowClient().get_metric_history(active.info.run_id, "stepdoctor.windows")
    finally:
        mlflow.set_tracking_uri(None)
    run, diagnosis = _expected(server, "ml", "loop")
    assert data.tags["stepdoctor.verdict"] == diagnosis["primary"]["kind"]
    assert data.tags["stepdoctor.run_page"] == f"{server[0].url}/runs/{run['id']}"
    assert data.metrics["stepdoctor.gain"] == pytest.approx(diagnosis["primary"]["gain"])
    assert data.metrics["stepdoctor.share"] == pytest.approx(diagnosis["primary"]["share"])
    assert data.metrics["stepdoctor.steps"] == 4 and data.metrics["stepdoctor.step_time_ms_mean"] > 0
    assert [(m.step, m.value) for m in windows] == [(1, 1.0), (2, 2.0)]  # once per analysed window


def test_no_tracker_no_reporter_and_a_token_that_cannot_read_costs_nothing(
    server: tuple[ServerProcess, str],
    upload_only: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from stepdoctor.integrations import trackers

    for name in ("wandb", "mlflow"):  # as if neither were installed
        monkeypatch.setitem(sys.modules, name, None)
    assert not trackers.active_sinks()
    sd = _train(server, tmp_path / "spool", "none", "loop")
    assert sd.session.reporter is None

    class FakeRun:  # an active W&B run, as far as the reporter needs one
        summary: ClassVar[dict[str, Any]] = {}

    fake = type(sys)("wandb")
    fake.run = FakeRun()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    # An upload-only token may not read the verdict: training finishes, one warning, nothing logged.
    sd = _train(server, tmp_path / "spool2", "none", "upload-only", read_token=upload_only, tracker_timeout=5)
    assert FakeRun.summary == {}
    assert "refused to show the verdict (HTTP 403)" in caplog.text
