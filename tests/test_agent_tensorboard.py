"""Without a server, the agent's directory is a TensorBoard profiler log dir and a stepdoctor input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import stepdoctor
from stepdoctor_analysis.pipeline import analyze_path
from support.tensorboard import plugin_get, tensorboard_plugin, wait_for_run


def _train(spool: Path) -> None:
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with stepdoctor.profile(
        project="local", run="tb", server=None, spool=spool, skip_first=1, warmup=1, active=2, repeat=1
    ) as prof:
        for _ in range(6):
            opt.zero_grad()
            model(torch.randn(32, 64)).sum().backward()
            opt.step()
            prof.step()


@pytest.mark.slow
def test_local_directory_opens_in_tensorboard_and_analyze(tmp_path: Path) -> None:
    pytest.importorskip("torch_tb_profiler")
    spool = tmp_path / "traces"
    _train(spool)
    (trace,) = spool.rglob("*.pt.trace.json.gz")
    assert trace.parent == spool / "local" / "tb"
    report = analyze_path(trace).to_dict()
    assert len(report["steps"]) == 2

    log_path = tmp_path / "tensorboard.log"
    with tensorboard_plugin(spool, log_path) as base:
        wait_for_run(base, "local/tb", log_path)
        (worker,) = plugin_get(base, "/workers", run="local/tb", view="Overview")
        assert worker == trace.name.split(".")[0]
        (span,) = plugin_get(base, "/spans", run="local/tb", worker=worker) or [None]
        params = {"run": "local/tb", "worker": worker} | ({"span": span} if span else {})
        overview = plugin_get(base, "/overview", **params)
        assert len(overview["steps"]["rows"]) == len(report["steps"])
