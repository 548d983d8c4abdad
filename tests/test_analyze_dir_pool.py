"""``stepdoctor analyze DIR`` over many rank files: a process pool gives the output the serial path
gives, byte for byte (text and JSON); its run verdict is the server's for the same files (upload,
analyse, ``GET /runs/{id}/diagnosis``); ``analysed N/M ranks`` is shown with ``--progress``; a bad
file among them is one line and exit 2, as in the serial path."""

from __future__ import annotations

import gzip
import socket
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_analysis.cli import analyze as cli
from stepdoctor_analysis.parsing import job_files
from stepdoctor_analysis.pipeline import analyze_trace
from stepdoctor_analysis.rank_pool import summarise_files
from stepdoctor_analysis.run.verdict import verdict_of
from support import synthetic_dist as sd
from support.server import drain, upload

RANKS, SLOW = 12, 7


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # DDP ranks written in an order unlike their ranks' (file order is not job order)
    return sd.straggler_job(tmp_path_factory.mktemp("ranks"), ranks=RANKS, slow_rank=SLOW, extra=0.3)


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_pool_output_equals_the_serial_output(
    job: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    serial = _cli(capsys, str(job), "--format", fmt, "--jobs", "1")
    pooled = _cli(capsys, str(job), "--format", fmt, "--jobs", "3")
    assert serial[0] == pooled[0] == 0
    assert pooled[1] == serial[1]
    assert f"rank {SLOW}" in pooled[1]


def test_progress_counts_the_ranks(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "PROGRESS_AFTER_S", 0.0)
    shown: list[str] = []
    real = cli._Progress.__call__

    def seen(self: cli._Progress, stage: str) -> None:
        shown.append(stage)
        real(self, stage)

    monkeypatch.setattr(cli._Progress, "__call__", seen)
    rc, _, _ = _cli(capsys, str(job), "--format", "json", "--jobs", "2", "--progress")
    assert rc == 0
    counts = [s for s in shown if s.startswith("analysed ")]
    assert counts == [f"analysed {n}/{RANKS} ranks" for n in range(1, RANKS + 1)]
    _cli(capsys, str(job), "--format", "json", "--jobs", "2")  # not a terminal, no --progress: no counts
    assert [s for s in shown if s.startswith("analysed ")] == counts


def test_a_bad_file_among_many_is_one_line(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in sorted(job.iterdir())[:3]:
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "rank99.json").write_text('{"traceEvents": 3}')
    rc, out, err = _cli(capsys, str(bad), "--jobs", "2")
    assert rc == 2 and out == ""
    assert err.startswith("stepdoctor analyze: ") and len(err.strip().splitlines()) == 1


def _plain(verdict: dict[str, Any]) -> dict[str, Any]:
    """What depends on the traces only: not when it was stored nor the server's trace ids."""
    return {k: v for k, v in verdict.items() if k not in ("computed_at", "lead_trace_id")}


def test_offline_verdict_equals_the_servers(job: Path, client: TestClient, app: FastAPI) -> None:
    found = summarise_files(job_files(job), analyze_trace, workers=2)
    offline = msgspec.to_builtins(verdict_of([s for _, s in found]))
    assert [s["rank"] for s in offline["stragglers"]] == [SLOW]
    first = 0
    for path, _ in found:  # uploaded in the job's order, one agent process per rank
        body = gzip.compress(path.read_bytes())
        meta = {"host": socket.gethostname(), "pid": 1000 + int(path.stem.removeprefix("rank"))}
        resp = upload(client, body, run="pool-vs-server", rank=None, metadata=meta)
        assert resp.status_code == 201, resp.text
        first = first or int(resp.json()["id"])
    drain(app)
    run_id = client.get(f"/api/v1/traces/{first}").json()["run_id"]
    server = client.get(f"/api/v1/runs/{run_id}/diagnosis").json()["diagnosis"]
    assert _plain(server) == _plain(offline)
