"""``stepdoctor.profile(..., memory_snapshot=True)``: the CUDA allocator's history beside each window's trace;
off by default, a no-op without CUDA."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import stepdoctor
from stepdoctor.demo_train import make_loader, make_model, train
from stepdoctor.memory_snapshot import SNAPSHOT_DIR
from stepdoctor.spool import TRACE_SUFFIX

SMALL: dict[str, Any] = {"skip_first": 1, "warmup": 1, "active": 2, "flush_timeout": 10.0, "series": False}


@pytest.fixture(autouse=True)
def _agent_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPDOCTOR_RAISE_ERRORS", "1")  # an agent bug fails the test instead of a log line
    for var in ("STEPDOCTOR_SERVER", "STEPDOCTOR_TOKEN", "STEPDOCTOR_DISABLED", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-op without CUDA")
def test_without_cuda_a_memory_snapshot_is_a_no_op(tmp_path: Path) -> None:
    loader = make_loader(workers=0, batch_size=4, steps=5, sample_ms=0.0)
    with stepdoctor.profile("local", "snap", spool=tmp_path, memory_snapshot=True, **SMALL) as prof:
        train(prof, loader, make_model())
    run = tmp_path / "local" / "snap"
    assert len(list(run.glob(f"*{TRACE_SUFFIX}"))) == 1  # the window is captured as without the option
    assert not (run / SNAPSHOT_DIR).exists()


def _cuda_loop(spool: Path, **options: Any) -> Path:
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    with stepdoctor.profile("local", "gpu", spool=spool, **SMALL, **options) as prof:
        for _ in range(5):
            model(torch.randn(256, 512, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    torch.cuda.synchronize()
    return spool / "local" / "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_memory_snapshot_records_the_windows_allocations_beside_the_trace(tmp_path: Path) -> None:
    run = _cuda_loop(tmp_path, memory_snapshot=True)
    (trace,) = run.glob(f"*{TRACE_SUFFIX}")
    (snap,) = (run / SNAPSHOT_DIR).glob("*.pickle")
    assert trace.name.startswith(snap.stem)  # named after the window's trace
    data = pickle.loads(snap.read_bytes())
    assert data["segments"], "no allocator segments in the snapshot"
    actions = {e["action"] for trace_events in data["device_traces"] for e in trace_events}
    assert {"alloc", "free_completed"} <= actions
    # recording stopped with the window: an allocation now adds nothing to the history
    before = sum(len(t) for t in torch.cuda.memory._snapshot()["device_traces"])
    kept = torch.empty(3 << 20, device="cuda")
    assert sum(len(t) for t in torch.cuda.memory._snapshot()["device_traces"]) == before
    del kept


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_memory_snapshot_is_off_by_default(tmp_path: Path) -> None:
    run = _cuda_loop(tmp_path)
    assert len(list(run.glob(f"*{TRACE_SUFFIX}"))) == 1
    assert not (run / SNAPSHOT_DIR).exists()
