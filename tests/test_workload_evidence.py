"""Workload evidence read from the trace: grad mode from the ops autograd recorded, and CUDA-graph
replays that hide the host's view of the step (unknown, not inference).

Real H100 traces (``tests/fixtures/traces/cuda``) and small synthetic Kineto traces built here: an
inference forward with and without autograd's ``Sequence number`` on its matmul ops, and graph
replays of a training step, of a step no kernel name explains and of a decode step.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stepdoctor_analysis import parsing as parse
from stepdoctor_analysis.analyzers.workload import KINDS, Workload, detect_workload
from stepdoctor_analysis.parsing.schema import MATMUL_OPS
from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_analysis.report import contract
from stepdoctor_analysis.rules import RULES
from stepdoctor_analysis.rules.record import Hit
from support.fixtures import HTA_TRACES, TRACELENS_TRACES
from support.synthetic import TraceBuilder

CUDA = Path(__file__).parent / "fixtures" / "traces" / "cuda"
RULES_BY_ID = {r.id: r for r in RULES}
TRAINING_ONLY = {r.id for r in RULES if "inference" not in r.workloads}
INFERENCE_ONLY = {r.id for r in RULES if "training" not in r.workloads}


def _report(path: Path) -> dict[str, Any]:
    return analyze_path(path).to_dict()


def _advice(r: dict[str, Any]) -> set[str]:
    return {f["id"] for f in r["findings"]} | {f["id"] for f in r["recommendations"]}


# --- grad mode, read from the ops autograd recorded -------------------------------------------


def _seq_counts(path: Path) -> tuple[int, int]:
    """Independent of the parser: matmul-class cpu_ops, and those carrying a "Sequence number"."""
    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    rx = re.compile(MATMUL_OPS)
    ops = [e for e in events if e.get("cat") == "cpu_op" and rx.match(e.get("name", ""))]
    return len(ops), sum("Sequence number" in e.get("args", {}) for e in ops)


@pytest.mark.parametrize("name", ["input.json.gz", "inference_unscheduled.json.gz", "launch.after.json.gz"])
def test_parser_reads_sequence_numbers_on_matmul_ops_as_recorded(name: str) -> None:
    trace = parse.load_trace(CUDA / name)
    rx = re.compile(MATMUL_OPS)
    matmul = [i for i, n in enumerate(trace.host.name.tolist()) if rx.match(trace.strings[n])]
    n_ops, n_seq = _seq_counts(CUDA / name)
    assert len(matmul) == n_ops
    assert int((trace.host.grad_seq[matmul] >= 0).sum()) == n_seq
    assert int((trace.host.grad_seq >= 0).sum()) == n_seq  # never on an op outside MATMUL_OPS


@pytest.mark.parametrize(
    ("name", "enabled"),
    [
        ("inference_unscheduled.json.gz", False),  # ResNet-50 under torch.inference_mode()
        ("input.json.gz", True),  # training: the forward's convolutions are recorded
        ("compute_bf16.json.gz", True),
        ("launch.after.json.gz", None),  # a graph replay: no host op at all
    ],
)
def test_grad_mode_read_from_the_recorded_cuda_traces(name: str, enabled: bool | None) -> None:
    w = _report(CUDA / name)["workload"]
    assert w["grad_enabled"] is enabled
    assert w["grad_disabled"] is (enabled is False)
    assert ("Sequence number" in w["grad_evidence"]) is (enabled is not None)


def test_inference_mode_trace_gets_no_inference_mode_advice() -> None:
    r = _report(CUDA / "inference_unscheduled.json.gz")
    w = r["workload"]
    assert w["kind"] == "inference" and w["grad_disabled"]
    assert any("no matmul-class op of" in e for e in w["evidence"])
    assert "inference.inference_mode" not in _advice(r)


def _forward_trace(path: Path, *, op: str, seq: bool, steps: int = 4) -> Path:
    """An inference loop (no backward): per step 60 ops ``op`` each launching a 3 µs kernel 25 µs
    apart (launch-bound), with autograd's sequence number on the ops when ``seq``."""
    b = TraceBuilder(training=False)
    t, n_seq = 100.0, 0
    for n in range(steps):
        start = t
        for _ in range(60):
            args = {"Sequence number": (n_seq := n_seq + 1), "Fwd thread id": 0} if seq else {}
            b.cpu_op(op, t, 22, args)
            b.launch("ampere_sgemm_32x32_sliced1x4_tn", t + 10, 8, t + 20, 3)
            t += 25
        b.step(n + 1, start, t + 10 - start)
        t += 20
    return b.write(path)


def test_inference_with_grad_on_gets_inference_mode_advice_naming_the_ops(tmp_path: Path) -> None:
    r = _report(_forward_trace(tmp_path / "on.json", op="aten::linear", seq=True))
    w = r["workload"]
    assert w["kind"] == "inference" and w["grad_enabled"] is True and not w["grad_disabled"]
    hit = next(f for f in r["findings"] if f["id"] == "inference.inference_mode")
    assert "autograd recorded 240 of 240 matmul-class ops" in hit["why"]
    assert hit["evidence"]["grad"] == w["grad_evidence"]
    guessed = _report(_forward_trace(tmp_path / "unknown.json", op="aten::add", seq=False))
    hit_guessed = next(f for f in guessed["findings"] if f["id"] == "inference.inference_mode")
    assert hit["confidence"] > hit_guessed["confidence"]  # read beats guessed


def test_inference_with_grad_off_gets_no_inference_mode_advice(tmp_path: Path) -> None:
    r = _report(_forward_trace(tmp_path / "off.json", op="aten::linear", seq=False))
    w = r["workload"]
    assert w["kind"] == "inference" and w["grad_enabled"] is False and w["grad_disabled"]
    assert "inference.inference_mode" not in _advice(r)
    assert "inference.cuda_graphs" in _advice(r)  # still inference advice, only not this one


def test_no_matmul_op_keeps_todays_low_confidence_guess(tmp_path: Path) -> None:
    """A sequence number on an op outside MATMUL_OPS is not read: no evidence either way."""
    r = _report(_forward_trace(tmp_path / "add.json", op="aten::add", seq=True))
    w = r["workload"]
    assert w["grad_enabled"] is None and not w["grad_disabled"] and w["grad_evidence"] == ""
    hit = next(f for f in r["findings"] if f["id"] == "inference.inference_mode")
    assert hit["confidence"] == RULES_BY_ID["inference.inference_mode"].thresholds["guess_confidence"]
    assert "no grad-disabling context" in hit["why"]


# --- CUDA-graph replays: the host cannot show the backward ------------------------------------

GEMM = "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize32x32x8_stage3_warpsize1x2x1_ffma_execute_kernel__5x_cublas"
RELU = "void at::native::vectorized_elementwise_kernel<4, at::native::launch_clamp_scalar<float>>(int)"
SGD = (
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>, "
    "std::plus<float>, float>(at::native::(anonymous namespace)::TensorListMetadata<2>)"
)
DECODE_ATTN = (
    "void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false>, true>(Flash_fwd_params)"
)


def _replay_trace(path: Path, kernels: list[str], *, steps: int = 4, pageable_mb: int = 0) -> Path:
    """Each step replays one CUDA graph (one ``cudaGraphLaunch``, every kernel on its correlation),
    as ``torch.cuda.graphs`` records it: no cpu_op, 2 µs kernels back to back. ``pageable_mb``: a
    pageable host-to-device copy before each replay."""
    b = TraceBuilder(training=False)
    t = 100.0
    for n in range(steps):
        start = t
        if pageable_mb:
            b.memcpy("HtoD", t, 2_000, t + 10, 1_990, pageable_mb << 20)
            t += 2_010
        corr = b.runtime("cudaGraphLaunch", t, 15)
        g = t + 20
        for name in kernels:
            b._gpu("kernel", name, g, 2, corr, 7, {"blocks per SM": 1.0})
            g += 2.5
        b.runtime("cudaDeviceSynchronize", t + 20, g - t - 15)
        t = g + 10
        b.step(n + 1, start, t - start)
        t += 5
    return b.write(path)


def test_recorded_graph_replay_of_a_training_step_is_not_inference() -> None:
    r = _report(CUDA / "launch.after.json.gz")
    w = r["workload"]
    assert w["kind"] != "inference" and w["cuda_graphs"]
    assert w["kind"] == "training"  # its SGD update shows as a foreach kernel
    assert any(e.startswith("optimizer kernel:") for e in w["evidence"])
    assert not _advice(r) & INFERENCE_ONLY


def test_synthetic_graph_replay_of_a_training_step_is_training(tmp_path: Path) -> None:
    r = _report(_replay_trace(tmp_path / "train.json", [GEMM, RELU] * 150 + [SGD] * 4))
    assert r["workload"]["kind"] == "training"
    assert r["workload"]["evidence"] == ["optimizer kernel: BinaryOpListAlphaFunctor"]


def test_graph_replay_no_kernel_explains_is_unknown_and_gets_neither_kind_of_advice(
    tmp_path: Path,
) -> None:
    """Decode-shaped (300 tiny kernels per step) but no name says decode, serving or training."""
    r = _report(_replay_trace(tmp_path / "unknown.json", [GEMM, RELU] * 150, pageable_mb=64))
    w = r["workload"]
    assert w["kind"] == "unknown" and w["phase"] is None
    assert any("replayed from CUDA graphs" in e for e in w["evidence"])
    ids = _advice(r)
    assert not ids & TRAINING_ONLY
    assert not ids & INFERENCE_ONLY
    assert "transfer.pinned_memory" in ids  # advice for any workload still comes
    assert contract.decode(r).workload is not None  # "unknown" is in the typed contract
    assert "the trace does not tell" in analyze_path(tmp_path / "unknown.json").render_text()


def test_graph_replay_of_a_decode_step_stays_inference(tmp_path: Path) -> None:
    layer = [GEMM, RELU, DECODE_ATTN, GEMM]
    r = _report(_replay_trace(tmp_path / "decode.json", layer * 64))
    w = r["workload"]
    assert w["kind"] == "inference" and w["phase"] == "decode" and w["cuda_graphs"]
    assert not _advice(r) & TRAINING_ONLY


def test_graph_replay_with_eager_ops_outside_the_graph_under_inference_mode_is_inference(
    tmp_path: Path,
) -> None:
    """A server's sampling runs eagerly after the replay; its matmul carries no sequence number."""
    path = _replay_trace(tmp_path / "serve.json", [GEMM, RELU] * 150)
    doc = json.loads(path.read_text())
    for e in [e for e in doc["traceEvents"] if e.get("name") == "cudaDeviceSynchronize"]:
        doc["traceEvents"].append(e | {"cat": "cpu_op", "name": "aten::mm", "args": {"External id": 1}})
    path.write_text(json.dumps(doc))
    w = _report(path)["workload"]
    assert w["kind"] == "inference" and w["grad_enabled"] is False


def test_gpu_only_trace_without_training_kernels_is_unknown() -> None:
    """No host op recorded at all (old category names, kernels and runtime calls only)."""
    w = _report(HTA_TRACES / "trace_file_list/inference_rank_1.json.gz")["workload"]
    assert w["kind"] == "unknown"


@pytest.mark.parametrize(
    "name",
    [
        "inference_vllm_decode_full_graph_execution.json.gz",
        "inference_sglang_decode_sglang_Qwen3-8B_decode.json.gz",
    ],
)
def test_real_graph_replaying_servers_stay_inference(name: str) -> None:
    w = _report(TRACELENS_TRACES / name)["workload"]
    assert w["kind"] == "inference" and w["cuda_graphs"] and w["phase"] == "decode"


def test_unknown_workload_gets_only_the_rules_that_fit_both_kinds() -> None:
    always = Hit(metric=1e9, removable_ns=1.0, evidence={})
    for rule in RULES:
        probe = dataclasses.replace(rule, query=lambda ctx, lim: always)
        for kind in ("training", "inference", "unknown"):
            fired = probe.evaluate(SimpleNamespace(workload=Workload(kind))) is not None  # type: ignore[arg-type]
            fits = set(KINDS) <= set(rule.workloads) if kind == "unknown" else kind in rule.workloads
            assert fired is fits, (rule.id, kind)
    assert {"launch.foreach_optimizer", "sync.host_sync", "compute.mixed_precision"} <= TRAINING_ONLY
    assert {"inference.host_sync"} <= INFERENCE_ONLY
    # "unknown" is decided in Rule.evaluate, never listed by a rule
    assert all("unknown" not in rule.workloads for rule in RULES)
    assert set(KINDS) <= set(RULES_BY_ID["communication.all_to_all"].workloads)


def test_metadata_still_decides_over_a_graph_replay(tmp_path: Path) -> None:
    trace = parse.load_trace(_replay_trace(tmp_path / "tagged.json", [GEMM, RELU] * 150))
    w = detect_workload(trace, [], {"tags": {"workload": "inference"}})
    assert w.kind == "inference" and w.source == "metadata"
