"""Op args the parser keeps (#9, #11): collectives typed and sized by what ``record_param_comms``
recorded, matmul precision from the launching op's ``Input type``, and the sparse-arg rule.

Expected figures are computed here from the events written (or, for the real NCCL fixture, from its
raw JSON), never copied from a report.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stepdoctor_analysis.model.trace import NONE, RankTrace
from stepdoctor_analysis.parsing import load_trace
from stepdoctor_analysis.parsing.columns import ABSENT_AFTER
from stepdoctor_analysis.pipeline import analyze_path
from support.fixtures import HTA_TRACES
from support.synthetic import TraceBuilder
from support.verdict_traces import DEVICES, LOADER

STEPS = 4
GEMM_FP32_NAMELESS = ("triton_tem_fused_mm_0", "cutlass_80_tensorop_gemm")
FP32 = ["float", "float"]
BF16 = ["c10::BFloat16", "c10::BFloat16"]
ELEM_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Long": 8, "Byte": 1}  # c10 ScalarType sizes


def _report(path: Path) -> dict[str, Any]:
    return analyze_path(path).to_dict()


def _ids(report: dict[str, Any], key: str = "findings") -> set[str]:
    return {x["id"] for x in report[key]}


def _by_type(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in report["metrics"]["communication"]["by_type"]}


def _strings(trace: RankTrace, col: np.ndarray, mask: np.ndarray | None = None) -> list[str]:
    sel = col != NONE if mask is None else mask & (col != NONE)
    return [trace.strings[int(i)] for i in col[sel]]


# --- 1. collectives typed by their recorded Collective name ------------------------------------

# (Collective name, In msg nelems, Out msg nelems, dtype, kernel it launches, µs, type expected).
# The kernels' names say nothing of the type (a generic NCCL kernel, a custom one linked only by
# External id) or the wrong thing (all-to-all run as NCCL SendRecv): the recorded name decides.
CALLS = [
    ("allreduce", 1 << 20, 1 << 20, "Float", "ncclDevKernel_Generic(ncclDevComm*)", 900.0, "all_reduce"),
    ("all_to_allv", 3_000, 5_000, "BFloat16", "ncclDevKernel_SendRecv(ncclDevComm*)", 300.0, "all_to_all"),
    ("alltoall_base", 6_000, 6_000, "BFloat16", "my_fused_exchange_kernel", 200.0, "all_to_all"),
    ("_allgather_base", 1_000, 8_000, "Half", "ncclDevKernel_Generic(ncclDevComm*)", 150.0, "all_gather"),
    (
        "reduce_scatter_tensor_coalesced",
        64_000,
        8_000,
        "Float",
        "ncclDevKernel_Generic_4(ncclDevComm*)",
        250.0,
        "reduce_scatter",
    ),
    ("send", 4_096, 4_096, "Long", "my_fused_exchange_kernel", 50.0, "send_recv"),
    ("recv", 2_048, 2_048, "Long", "ncclDevKernel_Generic(ncclDevComm*)", 70.0, "send_recv"),
]
WAIT_NELEMS = 1 << 30  # a 'wait' recording a huge message: counted anywhere, it would dominate


def _comm_args(name: str, n_in: int, n_out: int, dtype: str) -> dict[str, Any]:
    return {
        "Collective name": name,
        "In msg nelems": n_in,
        "Out msg nelems": n_out,
        "dtype": dtype,
        "Group size": 8,
        "Process Group Name": "0",
    }


def recorded_collectives_trace(path: Path) -> Path:
    """Per step: 1 ms of GEMMs, then each of ``CALLS`` back to back (exposed), then a ``wait``."""
    b = TraceBuilder(rank=0, world_size=8)
    t = 100.0
    for n in range(STEPS):
        start = t
        g = t + 10
        for _ in range(4):
            b.cpu_op("aten::mm", t, 8)
            b.launch("sm80_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x32", t + 1, 5, g, 250)
            t += 8
            g += 250
        for name, n_in, n_out, dtype, kernel, us, _ in CALLS:
            b.cpu_op("record_param_comms", t, 20, args=_comm_args(name, n_in, n_out, dtype))
            b.launch(kernel, t + 2, 6, max(g, t + 10), us)
            g = max(g, t + 10) + us
            t += 22
        b.cpu_op("record_param_comms", t, 5, args=_comm_args("wait", WAIT_NELEMS, WAIT_NELEMS, "Byte"))
        b.runtime("cudaStreamSynchronize", t + 6, max(1.0, g - t))
        t = max(t, g) + 10
        b.step(n + 1, start, t - start)
        t += 20
    return b.write(path)


def _expected_by_type() -> dict[str, dict[str, float]]:
    """Per type, per step: calls, bytes (max(In, Out) × element size), kernel µs (sequential)."""
    out: dict[str, dict[str, float]] = {}
    for _, n_in, n_out, dtype, _, us, kind in CALLS:
        e = out.setdefault(kind, {"calls": 0, "bytes": 0, "us": 0.0})
        e["calls"] += 1
        e["bytes"] += max(n_in, n_out) * ELEM_BYTES[dtype]
        e["us"] += us
    return out


def test_parser_keeps_record_param_comms_args(tmp_path: Path) -> None:
    trace = load_trace(recorded_collectives_trace(tmp_path / "c.json"))
    h = trace.host
    names = Counter(_strings(trace, h.collective))
    assert names == Counter({name: STEPS for name, *_ in CALLS} | {"wait": STEPS})
    rec = np.flatnonzero(h.collective != NONE)
    # Every recorded op keeps its own counts and dtype, in the host table's (time) order.
    got = [
        (
            trace.strings[int(h.collective[i])],
            int(h.in_nelems[i]),
            int(h.out_nelems[i]),
            trace.strings[int(h.msg_dtype[i])],
        )
        for i in rec
    ]
    want = [(name, n_in, n_out, dtype) for name, n_in, n_out, dtype, *_ in CALLS]
    want.append(("wait", WAIT_NELEMS, WAIT_NELEMS, "Byte"))
    assert got == want * STEPS
    # Nothing else carries them: not the GEMM ops, the launches or the step markers.
    others = h.collective == NONE
    assert (h.in_nelems[others] == NONE).all() and (h.msg_dtype[others] == NONE).all()
    # The values join the strings after the names: the names' own ids are those of a plain intern.
    assert trace.strings.index("record_param_comms") < trace.strings.index("allreduce")


def test_collectives_typed_and_sized_by_recorded_name(tmp_path: Path) -> None:
    r = _report(recorded_collectives_trace(tmp_path / "c.json"))
    by_type = _by_type(r)
    expected = _expected_by_type()
    assert set(by_type) == set(expected)  # no 'other' (generic names), no type for the 'wait'
    for kind, e in expected.items():
        c = by_type[kind]
        assert c["calls_per_step"] == e["calls"], kind  # kernels, typed by the op they were launched under
        assert c["recorded_calls_per_step"] == e["calls"], kind
        assert c["bytes_per_step"] == pytest.approx(e["bytes"]), kind
        assert c["mean_message_bytes"] == pytest.approx(e["bytes"] / e["calls"]), kind
        assert c["time_ns_per_step"] == pytest.approx(e["us"] * 1e3), kind
        # algbw: bytes per ns of collective time is GB/s (reported to 3 decimals).
        assert c["algbw_gbps"] == pytest.approx(e["bytes"] / (e["us"] * 1e3), abs=1e-3), kind
    # The custom-named kernel counts as communication (linked by External id), not compute.
    assert "my_fused_exchange_kernel" in by_type["all_to_all"]["top"] + by_type["send_recv"]["top"]
    assert by_type["all_reduce"]["exposed_ns_per_step"] == pytest.approx(900e3)


def test_wait_is_bookkeeping_on_a_cpu_gloo_job(tmp_path: Path) -> None:
    """No device: the host ops are the collective, counted once; its ``wait`` moves nothing."""
    b = TraceBuilder(gpu=False, rank=1, world_size=4)
    b.distributed = {"backend": "gloo", "rank": 1, "world_size": 4}
    t = 100.0
    for n in range(STEPS):
        start = t
        b.cpu_op("aten::addmm", t, 2_000)
        t += 2_000
        # One call, three nested ops: c10d::allreduce_ > record_param_comms > gloo:all_reduce.
        b.cpu_op("c10d::allreduce_", t, 1_500)
        b.cpu_op("record_param_comms", t, 1_500, args=_comm_args("allreduce", 250_000, 250_000, "Float"))
        b.cpu_op("gloo:all_reduce", t + 5, 1_490)
        t += 1_500
        b.cpu_op("record_param_comms", t, 300, args=_comm_args("wait", WAIT_NELEMS, WAIT_NELEMS, "Byte"))
        t += 300
        b.step(n + 1, start, t + 10 - start)
        t += 30
    r = _report(b.write(tmp_path / "gloo.json"))
    by_type = _by_type(r)
    assert set(by_type) == {"all_reduce"}  # a 'wait' taken for a collective: 'other', 300 µs
    ar = by_type["all_reduce"]
    assert ar["calls_per_step"] == ar["recorded_calls_per_step"] == 1  # the nested ops are one call
    assert ar["bytes_per_step"] == 250_000 * 4
    assert ar["time_ns_per_step"] == pytest.approx(1_500e3)  # the wait's 300 µs is not in it
    assert ar["algbw_gbps"] == pytest.approx(1e6 / 1.5e6, abs=1e-3)


def test_without_recorded_args_by_type_has_no_byte_figures(tmp_path: Path) -> None:
    """Older PyTorch: ``record_param_comms`` with no args; types come from names, sizes are unknown."""
    b = TraceBuilder(rank=0, world_size=2)
    t = 100.0
    for n in range(STEPS):
        start = t
        b.cpu_op("c10d::allreduce_", t, 30)
        b.cpu_op("record_param_comms", t + 2, 26)
        b.launch("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)", t + 4, 6, t + 12, 400)
        t += 430
        b.step(n + 1, start, t - start)
        t += 20
    c = _by_type(_report(b.write(tmp_path / "old.json")))["all_reduce"]
    assert c["calls_per_step"] == 1
    assert c["recorded_calls_per_step"] is None and c["bytes_per_step"] is None and c["algbw_gbps"] is None


# --- 2. matmul precision from the launching op's Input type --------------------------------------


def matmul_trace(path: Path, kernel: str, input_types: list[str] | None, *, arch: str = "sm80") -> Path:
    """Compute-bound steps: 40 × 250 µs of ``kernel`` per step, each launched by an ``aten::mm``
    whose ``Input type`` (record_shapes) is ``input_types`` (None: recorded without shapes)."""
    name, major = DEVICES[arch]
    b = TraceBuilder(device_name=name, compute_major=major)
    args = {"Input type": input_types, "Input Dims": [[512, 512], [512, 512]]} if input_types else None
    t = 100.0
    for n in range(STEPS + 1):
        start = t
        b.annotation(LOADER.replace("Single", "MultiProcessing"), t, 20)
        t += 20
        g = t + 10
        for _ in range(40):
            b.cpu_op("aten::mm", t, 8, args=args)
            b.launch(kernel, t + 1, 5, g, 250)
            t += 8
            g += 250
        t = max(g, t)
        b.step(n + 1, start, t + 10 - start)
        t += 20
    return b.write(path)


def _evidence(r: dict[str, Any], rule: str) -> dict[str, Any]:
    return next(f for f in r["findings"] if f["id"] == rule)["evidence"]


@pytest.mark.parametrize("kernel", GEMM_FP32_NAMELESS)
def test_fp32_op_dtype_makes_a_nameless_gemm_fp32_work(tmp_path: Path, kernel: str) -> None:
    r = _report(matmul_trace(tmp_path / "mm.json", kernel, FP32))
    assert r["primary"]["kind"] == "compute"
    first = r["recommendations"][0]
    assert first["id"] == "compute.mixed_precision" and "dtype=torch.bfloat16" in first["change"]
    ev = _evidence(r, "compute.mixed_precision")
    assert ev["matmul_us_by_precision"] == {"fp32": pytest.approx(10_000.0)}  # 40 × 250 µs per step
    src = ev["precision_sources"]
    assert src["by_op_dtype_us_per_step"] == {"fp32": pytest.approx(10_000.0)}
    assert src["decided_by_op_dtype_us_per_step"] == {"fp32": pytest.approx(10_000.0)}
    assert src["disagreements"] == []
    # The name alone: Triton's says nothing, CUTLASS's is a matmul of unknown precision.
    assert src["by_kernel_name_us_per_step"] == ({} if kernel.startswith("triton") else {"unknown": 10_000.0})
    assert r["metrics"]["ops"]["matmul_precision_evidence"] == src


@pytest.mark.parametrize("kernel", GEMM_FP32_NAMELESS)
def test_bf16_op_dtype_gets_no_precision_advice(tmp_path: Path, kernel: str) -> None:
    r = _report(matmul_trace(tmp_path / "mm.json", kernel, BF16))
    ids = _ids(r)
    assert "compute.mixed_precision" not in ids and "compute.tf32" not in ids
    assert "compute.no_cheap_win" in ids and "No cheap compute win" in r["primary"]["note"]
    ev = _evidence(r, "compute.no_cheap_win")
    assert ev["matmul_us_by_precision"] == {"bf16": pytest.approx(10_000.0)}
    assert ev["low_precision_fraction"] == 1.0
    assert ev["precision_sources"]["by_op_dtype_us_per_step"] == {"bf16": pytest.approx(10_000.0)}


def test_without_record_shapes_a_nameless_gemm_stays_undecided(tmp_path: Path) -> None:
    """The control: the same trace without ``Input type`` gives neither advice nor op evidence."""
    r = _report(matmul_trace(tmp_path / "mm.json", "triton_tem_fused_mm_0", None))
    assert not _ids(r) & {"compute.mixed_precision", "compute.no_cheap_win", "compute.tf32"}
    assert r["metrics"]["ops"]["matmul_precision_evidence"] == {}


def test_op_dtype_wins_where_the_kernel_name_disagrees(tmp_path: Path) -> None:
    kernel = "ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_nn"
    r = _report(matmul_trace(tmp_path / "mm.json", kernel, FP32))
    assert r["recommendations"][0]["id"] == "compute.mixed_precision"
    ev = _evidence(r, "compute.mixed_precision")
    assert ev["matmul_us_by_precision"] == {"fp32": pytest.approx(10_000.0)}
    src = ev["precision_sources"]
    assert src["by_kernel_name_us_per_step"] == {"fp16": pytest.approx(10_000.0)}  # both kept
    assert src["by_op_dtype_us_per_step"] == {"fp32": pytest.approx(10_000.0)}
    assert src["disagreements"] == [{"kernel": kernel, "kernel_name_says": "fp16", "op_dtype_says": "fp32"}]


def test_tf32_kernel_under_fp32_op_agrees(tmp_path: Path) -> None:
    """FP32 matmuls run on tensor cores as TF32: no disagreement, the name's TF32 is kept."""
    kernel = "ampere_tf32_s1688gemm_tf32_128x128_nn"
    r = _report(matmul_trace(tmp_path / "mm.json", kernel, FP32))
    src = r["metrics"]["ops"]["matmul_precision_evidence"]
    assert src["disagreements"] == [] and src["decided_by_op_dtype_us_per_step"] == {}
    assert r["metrics"]["ops"]["matmul_ns_by_precision"] == {"tf32": pytest.approx(10_000e3)}


def _repeated(b: TraceBuilder, iteration: Callable[[float], None], span: float) -> TraceBuilder:
    """``STEPS`` marked steps of 10 ``iteration(t)`` calls each, ``span`` µs apart."""
    t = 100.0
    for n in range(STEPS):
        start = t
        for _ in range(10):
            iteration(t)
            t += span
        b.step(n + 1, start, t + 10 - start)
        t += 20
    return b


def autocast_linear_trace(path: Path, *, old_kineto: bool = False) -> Path:
    """``aten::linear`` on FP32 inputs under bf16 autocast: its ``_to_copy`` casts (an elementwise
    kernel, 100 µs) then ``aten::addmm`` on bf16 runs a nameless GEMM (400 µs). ``old_kineto``: the
    launches carry ids of their own that name no op."""
    b = TraceBuilder()

    def linear(t: float) -> None:
        b.cpu_op("aten::linear", t, 30, args={"Input type": [*FP32, "float"]})
        b.cpu_op("aten::_to_copy", t + 2, 8, args={"Input type": ["float", "ScalarType"]})
        b.launch("void at::native::unrolled_elementwise_kernel<copy>(float*)", t + 3, 4, t + 40, 100)
        b.cpu_op("aten::addmm", t + 12, 15, args={"Input type": [*BF16, "c10::BFloat16"]})
        b.launch("cutlass_80_tensorop_gemm", t + 14, 6, t + 140, 400)

    _repeated(b, linear, 540)
    if old_kineto:
        for e in b.events:
            if e.get("cat") == "cuda_runtime":
                e["args"]["External id"] = 10_000_000 + e["args"]["correlation"]
    return b.write(path)


@pytest.mark.parametrize("old_kineto", [False, True])
def test_autocast_cast_kernels_are_not_fp32_matmul_work(tmp_path: Path, old_kineto: bool) -> None:
    r = _report(autocast_linear_trace(tmp_path / "amp.json", old_kineto=old_kineto))
    ops = r["metrics"]["ops"]
    # The cast is an elementwise kernel: never matmul work, whichever op launched it. With new
    # Kineto its launch names aten::_to_copy; with old Kineto (no launch names its op) the innermost
    # matmul op running at the launch, the FP32 aten::linear, would claim it but for its name.
    assert ops["matmul_ns_by_precision"] == {"bf16": pytest.approx(10 * 400e3)}
    assert "compute.mixed_precision" not in _ids(r)


def test_layout_and_norm_kernels_of_a_conv_are_not_its_matmul(tmp_path: Path) -> None:
    """cuDNN runs an FP32 NCHW convolution as NCHW->NHWC transform, an NHWC conv kernel, NHWC->NCHW,
    all launched by the conv op, and batch norm is a cuDNN kernel too: only the conv kernel is
    matmul work (cuda/inference_unscheduled: 4.2 of 5.1 ms 'FP32 matmul' per step were transforms
    and batch norm, and earned a TF32 card)."""
    b = TraceBuilder()

    def conv(t: float) -> None:
        b.cpu_op("aten::cudnn_convolution", t, 30, args={"Input type": [*FP32, "float"]})
        b.launch("void cudnn::engines_precompiled::nchwToNhwcKernel<float, float>", t + 2, 4, t + 40, 150)
        b.launch("sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc", t + 8, 4, t + 200, 300)
        b.launch("void cudnn::engines_precompiled::nhwcToNchwKernel<float, float>", t + 14, 4, t + 510, 100)
        b.cpu_op("aten::cudnn_batch_norm", t + 32, 10, args={"Input type": ["float"]})
        b.launch("void cudnn::bn_fw_inf_1C11_kernel_NCHW<float, float, true, 1>", t + 34, 4, t + 620, 200)

    _repeated(b, conv, 830)
    r = _report(b.write(tmp_path / "conv.json"))
    assert r["metrics"]["ops"]["matmul_ns_by_precision"] == {"tf32": pytest.approx(10 * 300e3)}


# --- 3. real NCCL traces, against an oracle from their raw JSON ------------------------------------

# nccl_data: NCCL kernels on the device (3 steps); ns_resolution: the same job's host side only (no
# collective kernels, 5 steps), where NCCL's host ops merely enqueue and time gives no bandwidth.
NCCL_FIXTURES = {
    "nccl_data": (HTA_TRACES / "nccl_parser_config/nccl_data.json.gz", 3, True),
    "ns_resolution": (
        HTA_TRACES / "ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
        5,
        False,
    ),
}
RECORDED_TYPE = {"allreduce": "all_reduce", "broadcast": "broadcast"}  # the names these traces record


def _raw_comm_ops(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    return [e for e in events if e.get("name") == "record_param_comms" and e.get("ph") == "X"]


@pytest.mark.parametrize("fixture", NCCL_FIXTURES)
def test_real_nccl_trace_columns_carry_recorded_args(fixture: str) -> None:
    path = NCCL_FIXTURES[fixture][0]
    raw = _raw_comm_ops(path)
    assert raw and all("Collective name" in e["args"] for e in raw)
    trace = load_trace(path)
    h = trace.host
    rec = h.collective != NONE
    # Only the record_param_comms ops carry them (the kernels' copies of the args are not read).
    assert {trace.strings[int(i)] for i in h.name[rec]} == {"record_param_comms"}
    assert Counter(_strings(trace, h.collective)) == Counter(e["args"]["Collective name"] for e in raw)
    got = Counter(
        (trace.strings[int(c)], int(i), int(o), trace.strings[int(d)])
        for c, i, o, d in zip(
            h.collective[rec], h.in_nelems[rec], h.out_nelems[rec], h.msg_dtype[rec], strict=True
        )
    )
    want = Counter(
        (a["Collective name"], a["In msg nelems"], a["Out msg nelems"], a["dtype"])
        for a in (e["args"] for e in raw)
    )
    assert got == want


@pytest.mark.parametrize("fixture", NCCL_FIXTURES)
def test_real_nccl_trace_bytes_per_type_match_raw_json(fixture: str) -> None:
    path, steps, on_device = NCCL_FIXTURES[fixture]
    raw = _raw_comm_ops(path)
    r = _report(path)
    windows = [(s["start_us"], s["start_us"] + s["duration_us"]) for s in r["steps"]]
    assert len(windows) == steps
    oracle: dict[str, dict[str, float]] = {}
    for e in raw:
        a = e["args"]
        if a["Collective name"] == "wait" or not any(lo <= e["ts"] < hi for lo, hi in windows):
            continue
        kind = RECORDED_TYPE[a["Collective name"]]  # KeyError: a name this oracle does not know
        o = oracle.setdefault(kind, {"calls": 0, "bytes": 0})
        o["calls"] += 1
        o["bytes"] += max(a["In msg nelems"], a["Out msg nelems"]) * ELEM_BYTES[a["dtype"]]
    assert set(oracle) == {"all_reduce", "broadcast"}
    by_type = _by_type(r)
    assert set(by_type) == set(oracle)  # the 'wait' ops (dtype Byte) are no type of their own
    for kind, o in oracle.items():
        c = by_type[kind]
        # One call each, whether counted by kernel or by its nested host ops (c10d > record > nccl).
        assert c["calls_per_step"] == c["recorded_calls_per_step"] == pytest.approx(o["calls"] / steps)
        assert c["bytes_per_step"] == pytest.approx(o["bytes"] / steps) and c["bytes_per_step"] > 0
        assert c["mean_message_bytes"] == pytest.approx(o["bytes"] / o["calls"])
        if on_device:
            assert c["algbw_gbps"] == pytest.approx(c["bytes_per_step"] / c["time_ns_per_step"], abs=1e-3)
            assert c["algbw_gbps"] > 0
        else:  # host time of an NCCL call is its enqueue: no bandwidth from it
            assert c["algbw_gbps"] is None


# --- 4. the sparse-arg rule: an arg its first carriers lacked is not looked for again -------------


def _ops_trace(
    path: Path, lead: int, lead_types: list[str] | None, tail: int, lead_name: str = "aten::bmm"
) -> Path:
    """``lead`` ``lead_name`` ops recorded with ``lead_types`` (None: without ``Input type``), then
    ``tail`` ``aten::mm`` ops with FP32 inputs; enough events to span several parse chunks."""
    b = TraceBuilder(gpu=False)
    lead_args = {"Input type": lead_types} if lead_types is not None else None
    t = 100.0
    for _ in range(lead):
        b.cpu_op(lead_name, t, 2, args=lead_args)
        t += 3
    for _ in range(tail):
        b.cpu_op("aten::mm", t, 2, args={"Input type": FP32})
        t += 3
    return b.write(path)


def _mm_dtypes(trace: RankTrace) -> list[str | None]:
    h = trace.host
    mm = np.flatnonzero(h.name == trace.strings.index("aten::mm"))
    return [None if h.input_dtype[i] == NONE else trace.strings[int(h.input_dtype[i])] for i in mm]


LEAD = 3 * ABSENT_AFTER  # several chunks of ops before the matmuls


def test_record_shapes_on_every_op_gives_every_op_its_dtype(tmp_path: Path) -> None:
    trace = load_trace(_ops_trace(tmp_path / "all.json", LEAD, ["float", "int"], 50))
    h = trace.host
    assert _strings(trace, h.input_dtype).count("float") == LEAD + 50  # none lost past any chunk
    assert _mm_dtypes(trace) == ["float"] * 50


def test_input_type_is_read_on_matmul_class_ops_only(tmp_path: Path) -> None:
    """Only the ops whose dtype decides a kernel's precision carry it into the model: reading every
    cpu_op's list cost ~10% of a parse (record_shapes writes it on all of them)."""
    trace = load_trace(_ops_trace(tmp_path / "mixed.json", 200, ["float", "int"], 50, "aten::add"))
    h = trace.host
    assert (h.input_dtype[h.name == trace.strings.index("aten::add")] == NONE).all()
    assert _mm_dtypes(trace) == ["float"] * 50


@pytest.mark.parametrize("lead_types", [["long", "ScalarType"], []], ids=["integer", "empty"])
def test_inputs_without_floats_still_show_record_shapes_is_on(tmp_path: Path, lead_types: list[str]) -> None:
    """A long run of ops with only integer (or no) inputs has ``Input type`` all the same: the
    matmuls after it keep their dtype (it is the arg's absence that stops the search)."""
    trace = load_trace(_ops_trace(tmp_path / "int.json", LEAD, lead_types, 50))
    assert (trace.host.input_dtype[trace.host.name == trace.strings.index("aten::bmm")] == NONE).all()
    assert _mm_dtypes(trace) == ["float"] * 50


def test_arg_absent_from_the_first_carriers_is_not_looked_for_again(tmp_path: Path) -> None:
    trace = load_trace(_ops_trace(tmp_path / "late.json", LEAD, None, 50))
    assert _mm_dtypes(trace) == [None] * 50  # record_shapes is per session: a late one is not read


def test_trace_without_any_op_args_parses_and_analyses(tmp_path: Path) -> None:
    path = matmul_trace(tmp_path / "plain.json", "ampere_sgemm_128x64_nn", None)
    trace = load_trace(path)
    h = trace.host
    for col in (h.input_dtype, h.collective, h.msg_dtype, h.in_nelems, h.out_nelems):
        assert (col == NONE).all()
    r = _report(path)
    assert r["recommendations"][0]["id"] == "compute.mixed_precision"  # by kernel name, as before
    assert r["metrics"]["ops"]["matmul_precision_evidence"] == {}
    assert "precision_sources" not in _evidence(r, "compute.mixed_precision")
