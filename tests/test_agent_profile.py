"""The agent around a real CPU training loop: what it captures, records and sends."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import stepdoctor
from stepdoctor import guard
from stepdoctor.demo_train import make_loader, make_model, train
from stepdoctor.series import SUFFIX as SERIES_SUFFIX
from stepdoctor.spool import META_SUFFIX, TRACE_SUFFIX
from support.fake_server import TOKEN, FakeServer

# TensorBoard profiler plugin's file pattern (torch-tb-profiler run loader)
TB_PATTERN = re.compile(r"^(.*?)(\.\d+)?\.pt\.trace\.json(\.gz)?$")
SMALL: dict[str, Any] = {
    "skip_first": 1,
    "warmup": 1,
    "active": 2,
    "flush_timeout": 10.0,
    "http_timeout": 5.0,
    "backoff_base": 0.05,
}

# An agent bug raised on the delivery thread (STEPDOCTOR_RAISE_ERRORS=1) must fail the test, not just warn.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


@pytest.fixture(autouse=True)
def _agent_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPDOCTOR_RAISE_ERRORS", "1")
    for var in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "TORCHELASTIC_RUN_ID",
        "SLURM_JOB_ID",
        "STEPDOCTOR_DISABLED",
    ):
        monkeypatch.delenv(var, raising=False)
    for var in ("STEPDOCTOR_SERVER", "STEPDOCTOR_TOKEN", "STEPDOCTOR_PROJECT", "STEPDOCTOR_RUN"):
        monkeypatch.delenv(var, raising=False)


def step_names(trace: dict[str, Any]) -> list[int]:
    return sorted(
        int(e["name"].split("#")[1])
        for e in trace["traceEvents"]
        if str(e.get("name", "")).startswith("ProfilerStep#")
    )


def test_traces_arrive_with_metadata_rank_and_loader_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-77")
    monkeypatch.setenv("STEPDOCTOR_TOKEN", TOKEN)
    loader = make_loader(workers=2, batch_size=8, steps=8, sample_ms=0.2)
    with FakeServer() as server:
        monkeypatch.setenv("STEPDOCTOR_SERVER", server.url)
        with stepdoctor.profile(
            "agent-test", "meta", spool=tmp_path, loader=loader, tags={"team": "vision"}, repeat=2, **SMALL
        ) as prof:
            steps = len(train(prof, loader, make_model()))
        assert steps == 8 and prof.captured == 2
        uploads = sorted(server.uploads.values(), key=lambda u: u.metadata["window"]["index"])
    assert len(uploads) == 2
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    for index, upload in enumerate(uploads):
        meta = upload.metadata
        assert (upload.project, upload.run, upload.rank) == ("agent-test", "meta", 3)
        assert (meta["rank"], meta["local_rank"], meta["world_size"]) == (3, 1, 4)
        assert meta["job_id"] == "job-77" and meta["tags"] == {"team": "vision"}
        assert meta["torch"] == torch.__version__ and meta["cpu_count"] == os.cpu_count()
        if git.returncode == 0:  # read from .git by the agent, without running git
            assert meta["git_commit"] == git.stdout.strip()
        assert meta["loader"] == {
            "batch_size": 8,
            "num_workers": 2,
            "pin_memory": False,
            "prefetch_factor": 2,
            "persistent_workers": False,
            "type": "DataLoader",
        }
        window = meta["window"]
        assert window["index"] == index
        # skip 1, then cycles of warm-up 1 + record 2, twice: steps 2-3 and 5-6
        assert (window["first_step"], window["last_step"]) == (2 + 3 * index, 3 + 3 * index)
        assert step_names(upload.trace) == [window["first_step"], window["last_step"]]
        assert upload.trace["distributedInfo"] == {"rank": 3, "world_size": 4}
    assert not list(tmp_path.glob(f"*/*/*{META_SUFFIX}"))  # acknowledged traces leave the queue
    assert len(list(tmp_path.glob(f"uploaded/agent-test/meta/*{TRACE_SUFFIX}"))) == 2  # as local copies


def test_without_a_server_traces_stay_in_tensorboard_layout(tmp_path: Path) -> None:
    loader = make_loader(workers=0, batch_size=4, steps=5, sample_ms=0.0)
    prof = stepdoctor.profile("local", "offline", spool=tmp_path, **SMALL)
    prof.watch(loader)
    with prof:
        train(prof, loader, make_model())
    files = sorted((tmp_path / "local" / "offline").iterdir())
    traces = [f for f in files if TB_PATTERN.match(f.name)]
    assert len(traces) == 1 and traces[0].name.endswith(TRACE_SUFFIX)
    worker, _, _ = TB_PATTERN.match(traces[0].name).groups()  # type: ignore[union-attr]
    assert re.fullmatch(r".+_\d+", worker)
    trace = json.loads(gzip.decompress(traces[0].read_bytes()))
    assert step_names(trace) == [2, 3]
    assert any(e.get("name") == "[memory]" for e in trace["traceEvents"])  # memory tracking on by default
    assert any("Input Dims" in e.get("args", {}) for e in trace["traceEvents"])  # record_shapes on
    sidecar = json.loads(next(f for f in files if f.name.endswith(META_SUFFIX)).read_text())
    assert sidecar["server"] is None and sidecar["metadata"]["loader"]["num_workers"] == 0
    # besides the trace and its sidecar, only the step series (stepdoctor.series) is left there
    assert [f for f in files if f not in traces and not f.name.endswith((META_SUFFIX, SERIES_SUFFIX))] == []


def test_analyze_reads_the_local_spool(tmp_path: Path) -> None:
    pipeline = pytest.importorskip("stepdoctor_analysis.pipeline")
    from stepdoctor_analysis import BOTTLENECK_KINDS

    loader = make_loader(workers=0, batch_size=4, steps=5, sample_ms=0.5)
    with stepdoctor.profile("local", "analyze", spool=tmp_path, **SMALL) as prof:
        train(prof, loader, make_model())
    report = pipeline.analyze_path(tmp_path / "local" / "analyze").to_dict()
    assert report["primary"]["kind"] in BOTTLENECK_KINDS


def test_periodic_capture_and_profiler_kwargs_pass_through(tmp_path: Path) -> None:
    seen: list[int] = []
    prof = stepdoctor.profile(
        "local",
        "periodic",
        spool=tmp_path,
        skip_first=0,
        warmup=1,
        active=1,
        every=3,
        profiler_kwargs={"on_trace_ready": lambda p: seen.append(p.step_num), "with_flops": True},
    )
    assert isinstance(prof, stepdoctor.Profile)
    with prof:
        for _ in range(9):
            make_model()(torch.randn(2, 768)).sum().backward()
            prof.step()
        assert prof.profiler.with_flops is True
    assert len(seen) == 3 and prof.captured == 3  # one window per 3 steps, user callback chained
    assert len(list((tmp_path / "local" / "periodic").glob(f"*{TRACE_SUFFIX}"))) == 3


def test_disabled_gives_a_noop_with_the_same_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPDOCTOR_DISABLED", "1")
    prof = stepdoctor.profile("p", "r", spool=tmp_path)
    assert isinstance(prof, stepdoctor.NoopProfile) and not prof.enabled
    public = {n for n in dir(stepdoctor.Profile) if not n.startswith("_")} - {"config"}
    assert public <= {n for n in dir(prof) if not n.startswith("_")}
    with prof as p:
        p.step()
        assert p.watch([1]) == [1] and p.flush(0.1)
    assert not any(tmp_path.iterdir())


def test_missing_torch_gives_a_noop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.profiler", None)  # import now raises ImportError
    assert isinstance(stepdoctor.profile("p", "r", spool=tmp_path), stepdoctor.NoopProfile)


def test_agent_errors_never_reach_the_training_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("an agent bug")

    # An unwritable spool is an expected condition, handled (test_agent_spool_write); a bug is not.
    monkeypatch.setattr("stepdoctor.metadata.collect", broken)
    monkeypatch.setenv("STEPDOCTOR_RAISE_ERRORS", "0")
    guard.reset_reported()
    with stepdoctor.profile("p", "r", spool=tmp_path, **SMALL) as prof:
        for _ in range(4):
            prof.step()
    assert prof.captured == 0
    monkeypatch.setenv("STEPDOCTOR_RAISE_ERRORS", "1")  # and tests see the same bug loudly
    with pytest.raises(RuntimeError, match="an agent bug"):
        stepdoctor.profile("p", "r", spool=tmp_path, **SMALL).start()


def test_the_next_run_uploads_what_an_earlier_run_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEPDOCTOR_TOKEN", TOKEN)
    server = FakeServer(start=False)
    quick = {**SMALL, "flush_timeout": 0.3}
    with stepdoctor.profile("agent-test", "first", server=server.url, spool=tmp_path, **quick) as first:
        for _ in range(4):
            first.step()
    assert first.captured == 1 and first.stats.delivered == 0
    left = {json.loads(p.read_text())["idempotency_key"] for p in tmp_path.rglob(f"*{META_SUFFIX}")}
    server.up()
    try:
        with stepdoctor.profile("agent-test", "second", server=server.url, spool=tmp_path, **SMALL) as second:
            for _ in range(4):
                second.step()
        assert sorted(u.run for u in server.uploads.values()) == ["first", "second"]
        assert left <= set(server.uploads) and second.stats.delivered == 2
    finally:
        server.down()


def test_fast_path_window_prediction_matches_torch_schedule() -> None:
    """Outside windows step() skips the schedule lookup; the predicted next window must be exact."""
    from stepdoctor.profiler import NEVER, next_window_start

    none = torch.profiler.ProfilerAction.NONE
    for skip_first, wait, warmup, active, repeat in [
        (0, 0, 1, 1, 0),
        (5, 3, 2, 3, 1),
        (1, 4, 0, 2, 2),
        (10, 0, 2, 3, 0),
    ]:
        schedule = torch.profiler.schedule(
            skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat
        )
        for step in range(80):
            expected = next((s for s in range(step, 300) if schedule(s) != none), NEVER)
            assert next_window_start(step, skip_first, wait, warmup, active, repeat) == expected


def test_a_custom_schedule_is_honoured(tmp_path: Path) -> None:
    action = torch.profiler.ProfilerAction
    plan = {5: action.WARMUP, 6: action.RECORD, 7: action.RECORD_AND_SAVE}
    with stepdoctor.profile(
        "local", "custom", spool=tmp_path, profiler_kwargs={"schedule": lambda s: plan.get(s, action.NONE)}
    ) as prof:
        for _ in range(10):
            make_model()(torch.randn(2, 768)).sum().backward()
            prof.step()
    (trace_file,) = (tmp_path / "local" / "custom").glob(f"*{TRACE_SUFFIX}")
    assert step_names(json.loads(gzip.decompress(trace_file.read_bytes()))) == [6, 7]


def test_secrets_on_the_command_line_are_not_sent() -> None:
    from stepdoctor.metadata import redacted_argv

    argv = [
        "train.py",
        "--token",
        "sdt_abc",
        "--api-key=xyz",
        "--lr",
        "0.1",
        "--wandb_token=q",
        "--tokens",
        "5",
    ]
    assert redacted_argv(argv) == [
        "train.py", "--token", "***", "--api-key=***", "--lr", "0.1", "--wandb_token=***", "--tokens", "***",
    ]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_activity_and_devices_are_recorded(tmp_path: Path) -> None:
    model = torch.nn.Linear(256, 256).cuda()
    with stepdoctor.profile("local", "gpu", spool=tmp_path, **SMALL) as prof:
        for _ in range(5):
            model(torch.randn(64, 256, device="cuda")).sum().backward()
            torch.cuda.synchronize()
            prof.step()
    sidecar = json.loads(next((tmp_path / "local" / "gpu").glob(f"*{META_SUFFIX}")).read_text())
    meta = sidecar["metadata"]
    assert meta["device_count"] == torch.cuda.device_count() and meta["devices"][0]["total_memory"] > 0
    (trace_file,) = (tmp_path / "local" / "gpu").glob(f"*{TRACE_SUFFIX}")
    trace = json.loads(gzip.decompress(trace_file.read_bytes()))
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])
