"""Beyond single-node DDP training (issue 11): collectives by type, stragglers by work before the
collective, ranks vs windows, allocator stalls, and inference advice. Each case asserts the kind,
the collective type or workload detected, the first recommendation and what must not be advised."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from stepdoctor_analysis.model.collectives import collective_type, is_collective_kernel_name
from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_analysis.report.contract import decode
from stepdoctor_analysis.run.ranks import TraceEntry, rank_verdict, worker_name
from stepdoctor_server.runs.diagnosis import StoredTrace, aggregate_run
from support import synthetic_dist as sd
from support.cpu_loops import _record
from support.fixtures import HTA_TRACES, TRACELENS_TRACES
from support.reports import report as valid_report

TRAINING_ADVICE = {
    "memory.zero_grad_set_to_none",
    "launch.foreach_optimizer",
    "communication.overlap",
    "compute.mixed_precision",
    "launch.cuda_graphs",
    "sync.host_sync",
}


def _ids(report: dict[str, Any], key: str = "findings") -> set[str]:
    return {r["id"] for r in report[key]}


def _analyze(path: Path) -> dict[str, Any]:
    return analyze_path(path).to_dict()


def _dominant(report: dict[str, Any]) -> str:
    by_type = report["metrics"]["communication"]["by_type"]
    return max(by_type, key=lambda c: (c["exposed_ns_per_step"], c["time_ns_per_step"]))["type"]


# --- 1. collectives recognised by what the profiler records --------------------------------------


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)", "all_reduce"),
        ("ncclKernel_ReduceScatter_RING_LL_Sum_bfloat16(ncclWorkElem)", "reduce_scatter"),
        ("void dpsk::ep::intranode::dispatch<8, 768>(int4*, int)", "all_to_all"),
        ("void deep_ep::internode::combine<true>(int4*)", "all_to_all"),
        ("void vllm::cross_device_reduce_1stage<half, 8>(...)", "all_reduce"),
        ("multimem_all_reduce_kernel", "all_reduce"),
        ("mscclKernel_Sum_half_LL128(int)", None),
    ],
)
def test_collective_kernel_families(name: str, kind: str | None) -> None:
    assert is_collective_kernel_name(name)
    assert collective_type(name) == kind
    assert not is_collective_kernel_name("void at::native::vectorized_elementwise_kernel<4>(add)")
    assert not is_collective_kernel_name("_combined_routing_compute")  # vLLM MoE routing is compute


def test_deepep_kernels_are_communication_mostly_hidden(tmp_path: Path) -> None:
    r = _analyze(sd.deepep_trace(tmp_path / "deepep.json"))
    a2a = {c["type"]: c for c in r["metrics"]["communication"]["by_type"]}["all_to_all"]
    assert a2a["libraries"] == ["deepep"]
    assert a2a["time_ns_per_step"] == pytest.approx(98_600_000, rel=1e-3)  # counted as comm, not compute
    assert a2a["overlapped_ns_per_step"] == pytest.approx(96_000_000, rel=1e-2)
    assert a2a["exposed_ns_per_step"] == pytest.approx(2_600_000, rel=5e-2)
    assert r["breakdown"]["communication"] > 0
    assert "communication.all_to_all" not in _ids(r, "recommendations")  # 2.6% exposed: nothing to fix


def test_record_param_comms_types_real_nccl_trace() -> None:
    r = _analyze(HTA_TRACES / "trace_filter/sampled_rank-0.json.gz")
    types = {c["type"] for c in r["metrics"]["communication"]["by_type"]}
    # SendRecv kernels typed by the nccl:all_to_all / _all_gather_base ranges they were launched under.
    assert {"all_to_all", "all_gather"} <= types


# --- 2. advice follows the dominant collective --------------------------------------------------


@pytest.mark.parametrize(
    ("builder", "dominant", "first"),
    [
        (sd.all_to_all_trace, "all_to_all", "communication.all_to_all"),
        (sd.fsdp_trace, "all_gather", "communication.fsdp_prefetch"),
        (sd.pipeline_trace, "send_recv", "communication.pipeline_bubbles"),
    ],
)
def test_communication_advice_by_collective_type(
    tmp_path: Path, builder: Any, dominant: str, first: str
) -> None:
    r = _analyze(builder(tmp_path / "t.json"))
    assert r["primary"]["kind"] == "communication"
    assert r["workload"]["kind"] == "training"
    assert _dominant(r) == dominant
    assert r["recommendations"][0]["id"] == first
    assert "communication.overlap" not in _ids(r)  # DDP bucket_cap_mb / compression hook: wrong fix


def test_real_recommendation_model_gets_all_to_all_advice() -> None:
    """HTA's ``trace_diff/control``: rank 3 of 8 of a TorchRec job (KJT all-to-all, DDP all-reduce)."""
    r = _analyze(HTA_TRACES / "trace_diff/control/control.json.gz")
    assert r["primary"]["kind"] == "communication"
    assert _dominant(r) == "all_to_all"
    assert r["recommendations"][0]["id"] == "communication.all_to_all"
    assert "communication.overlap" not in _ids(r)


def test_metadata_tag_declares_the_workload(tmp_path: Path) -> None:
    from stepdoctor_analysis import parsing as parse
    from stepdoctor_analysis.pipeline import analyze_trace

    trace = parse.load_trace(sd.all_to_all_trace(tmp_path / "t.json"))
    report = analyze_trace(trace, metadata={"tags": {"workload": "inference"}}).to_dict()
    assert report["workload"]["kind"] == "inference" and report["workload"]["source"] == "metadata"
    assert not _ids(report) & TRAINING_ADVICE


def test_tensor_parallel_inference_all_reduce(tmp_path: Path) -> None:
    r = _analyze(sd.tp_inference_trace(tmp_path / "tp.json"))
    assert r["workload"]["kind"] == "inference"
    assert _dominant(r) == "all_reduce"
    by_type = r["metrics"]["communication"]["by_type"]
    assert by_type[0]["libraries"] == ["custom_all_reduce"]
    assert r["recommendations"][0]["id"] == "communication.tensor_parallel"
    assert not _ids(r) & TRAINING_ADVICE


# --- 3. stragglers by work before the collective; CLI and server agree ---------------------------


def _server_diagnosis(directory: Path) -> dict[str, Any]:
    """The server's run diagnosis over the per-trace reports its worker stores."""
    reports = [analyze_path(f).to_dict() for f in sorted(directory.iterdir())]
    verdict = aggregate_run([StoredTrace(i, r["rank"], 0, None, r) for i, r in enumerate(reports)])
    out: dict[str, Any] = msgspec.to_builtins(verdict)
    return out


def test_straggler_is_the_rank_that_works_longer_and_both_paths_agree(tmp_path: Path) -> None:
    job = sd.straggler_job(tmp_path / "job", ranks=3, slow_rank=1)
    cli = _analyze(job)
    server = _server_diagnosis(job)
    # Step times are equal (synchronised all-reduce): the longest step does not name the straggler.
    times = [r["step_time_us"] for r in cli["ranks"]["per_rank"]]
    assert max(times) / min(times) < 1.01
    assert cli["ranks"]["stragglers"] == [1]
    assert [s["rank"] for s in server["stragglers"]] == [1]
    detail = cli["ranks"]["straggler_details"][0]
    assert detail["cause"] == "compute" and detail["arrival_late_us"] > 1_000
    assert server["stragglers"][0]["cause"] == "compute"
    assert cli["ranks"]["count"] == len(server["ranks"]) == 3
    assert cli["primary"]["kind"] == server["primary"]["kind"]  # one job verdict (``job.job_limiter``)
    # The others wait for rank 1: the first advice is to even out the ranks, not DDP bucket sizes.
    assert cli["recommendations"][0]["id"] == server["recommendations"][0]["id"] == "communication.straggler"
    assert "tokens per rank" in cli["recommendations"][0]["change"]
    assert any("straggler" in w for w in cli["warnings"])


def test_symmetric_job_verdict_agrees_on_both_paths(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    for r in range(2):
        sd.all_to_all_trace(job / f"rank{r}.json", rank=r, world_size=2)
    cli, server = _analyze(job), _server_diagnosis(job)
    assert cli["primary"]["kind"] == server["primary"]["kind"] == "communication"
    assert cli["ranks"]["stragglers"] == [] and server["stragglers"] == []
    assert cli["recommendations"][0]["id"] == server["recommendations"][0]["id"] == "communication.all_to_all"


def test_ranks_at_100_and_120_us_agree_on_both_paths() -> None:
    times = {0: 100.0, 1: 120.0}
    reports = {r: valid_report(rank=r, step_time_us=t, source=f"r{r}") for r, t in times.items()}
    direct = rank_verdict([TraceEntry(decode(rep)) for rep in reports.values()])
    server = aggregate_run([StoredTrace(r, r, 0, None, rep) for r, rep in reports.items()])
    assert direct.straggler_ranks() == [1]
    assert [s.rank for s in server.stragglers] == [1]


# --- 4. windows are not ranks --------------------------------------------------------------------


def test_two_windows_of_one_rank_are_windows(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    sd.all_to_all_trace(job / "w0.json", rank=0)
    sd.fsdp_trace(job / "w1.json", rank=0)
    cli = _analyze(job)
    assert cli["ranks"]["count"] == 1 and cli["ranks"]["windows"] == 2
    assert cli["ranks"]["stragglers"] == []
    assert any("capture windows" in w for w in cli["warnings"])
    server = _server_diagnosis(job)
    assert len(server["ranks"]) == 1 and server["ranks"][0]["traces"] == 2 and server["stragglers"] == []


def test_traces_without_rank_group_by_tensorboard_worker() -> None:
    entries = [
        TraceEntry(decode(valid_report(source=name, step_time_us=t)), worker=worker_name(name))
        for name, t in (("host_11.100.pt.trace.json", 100.0), ("host_11.200.pt.trace.json", 300.0))
    ]
    verdict = rank_verdict(entries)
    assert verdict.count == 1 and verdict.windows == 2 and verdict.stragglers == []


def test_analyze_lists_the_runs_of_a_tensorboard_logdir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stepdoctor_analysis.cli import analyze as cli

    for run in ("baseline", "team/fsdp"):
        (tmp_path / run).mkdir(parents=True)
    sd.all_to_all_trace(tmp_path / "baseline" / "host_1.100.pt.trace.json", rank=0, world_size=2)
    sd.all_to_all_trace(tmp_path / "baseline" / "host_2.100.pt.trace.json", rank=1, world_size=2)
    sd.fsdp_trace(tmp_path / "team" / "fsdp" / "host_1.200.pt.trace.json", rank=0)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "x.json").write_text("{not json")
    assert cli.main([str(tmp_path), "--format", "json"]) == 0
    runs = {r["run"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert set(runs) == {"baseline", "team/fsdp", "broken"}
    assert runs["baseline"]["ranks"] == 2 and runs["baseline"]["next"]["id"] == "communication.all_to_all"
    assert runs["team/fsdp"]["next"]["id"] == "communication.fsdp_prefetch"
    assert "error" in runs["broken"]
    assert cli.main([str(tmp_path)]) == 0
    assert "log directory of 3 runs" in capsys.readouterr().out
    assert cli.main([str(tmp_path), "--deep", "critical-path"]) == 2  # needs one run: a one-line refusal
    assert "3 runs" in capsys.readouterr().err


# --- 5. allocator stalls whatever the step count -------------------------------------------------


def test_hipfree_dominated_ddp_is_memory_bound(tmp_path: Path) -> None:
    r = _analyze(sd.hipfree_ddp_trace(tmp_path / "ddp_hipfree.json"))
    assert len(r["steps"]) == 1
    assert r["primary"]["kind"] == "memory"
    assert r["metrics"]["memory"]["allocator"] == "disabled"
    assert r["metrics"]["shares"]["memory"] > 0.9
    assert r["recommendations"][0]["id"] == "memory.allocator_disabled"
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING" in r["recommendations"][0]["change"]
    assert "launch.cuda_graphs" not in _ids(r) and "memory.allocator_steady_state" not in _ids(r)


def test_allocator_missing_its_cache_in_steady_state_is_thrashing_not_disabled(tmp_path: Path) -> None:
    from support.synthetic import allocator_churn_trace

    r = _analyze(allocator_churn_trace(tmp_path / "churn.json"))
    mem = r["metrics"]["memory"]
    assert mem["allocator"] == "thrashing"  # 2 calls per step, reserved above allocated: a cache that misses
    assert mem["allocator_evidence"]["by_api"] == {"cudaFree": 5, "cudaMalloc": 5}
    assert "memory.allocator_steady_state" in _ids(r) and "memory.allocator_disabled" not in _ids(r)


# --- 6. inference gets inference advice ---------------------------------------------------------


def _eval_loop(path: Path) -> Path:
    """A real CPU serving loop: a model in eval() without inference_mode, batch 1, prof.step() per request."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(12)]
    )
    model.eval()
    requests = [torch.randn(1, 64) for _ in range(8)]

    def serve() -> Any:
        while True:
            for x in requests:
                for _ in range(4):  # a few forward passes per request (e.g. re-ranking candidates)
                    model(x)
                yield

    return _record(path, serve())


@pytest.fixture(scope="module")
def eval_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _eval_loop(tmp_path_factory.mktemp("eval") / "eval.json")


def test_cpu_eval_loop_gets_inference_advice(eval_trace: Path) -> None:
    r = _analyze(eval_trace)
    assert r["workload"]["kind"] == "inference"
    assert r["device"] is None
    first = r["recommendations"][0]["id"]
    assert first.startswith("inference."), first
    # Which share dominates is the machine's: on a quiet one the per-op host cost (launch), and
    # autograd's bookkeeping is part of it; on a loaded one the ops' own time can outweigh it.
    if r["primary"]["kind"] == "launch":
        assert "inference.inference_mode" in _ids(r)
    assert not _ids(r) & TRAINING_ADVICE
    assert "input.dataloader_workers" not in _ids(r)


def test_decode_loop_recognised_by_many_tiny_kernels_per_token(tmp_path: Path) -> None:
    r = _analyze(sd.decode_loop_trace(tmp_path / "decode.json"))
    assert r["workload"]["kind"] == "inference" and r["workload"]["phase"] == "decode"
    assert r["primary"]["kind"] == "launch"
    first = r["recommendations"][0]
    assert first["id"] == "inference.cuda_graphs" and 'cache_implementation = "static"' in first["change"]
    assert not _ids(r) & TRAINING_ADVICE


@pytest.mark.parametrize(
    ("name", "phase"),
    [
        ("inference_sglang_decode_sglang_Qwen3-8B_decode.json.gz", "decode"),
        ("inference_sglang_prefilldecode_sglang_Qwen3-8B_prefilldecode.json.gz", "prefill"),
        ("inference_vllm_decode_full_graph_execution.json.gz", "decode"),
        ("h100_gaunernst_bert-small-uncased__1016001.json.gz", None),
    ],
)
def test_real_inference_traces_get_no_training_advice(name: str, phase: str | None) -> None:
    r = _analyze(TRACELENS_TRACES / name)
    assert r["workload"]["kind"] == "inference"
    assert r["workload"]["phase"] == phase
    assert not _ids(r) & TRAINING_ADVICE


def test_hf_bert_inference_first_advice_is_for_inference() -> None:
    r = _analyze(TRACELENS_TRACES / "h100_gaunernst_bert-small-uncased__1016001.json.gz")
    assert r["primary"]["kind"] == "launch"
    assert r["recommendations"][0]["id"] == "inference.cuda_graphs"
    assert "static" not in r["recommendations"][0]["change"]  # not a decode loop: no KV cache advice


def test_training_fixture_stays_training() -> None:
    r = _analyze(HTA_TRACES / "nccl_parser_config/nccl_data.json.gz")
    assert r["workload"]["kind"] == "training"
    assert not any(i.startswith("inference.") for i in _ids(r))
