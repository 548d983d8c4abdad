"""Steps, step-time breakdown, GPU metrics and HTA-style metrics.

Hand-built traces check each definition against numbers worked out by hand from anchors §2–3; the
real fixtures check invariants that must hold on whatever users upload.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stepdoctor_analysis.analyzers import hta_metrics as hm
from stepdoctor_analysis.analyzers.breakdown import CATEGORIES, compute_breakdown
from stepdoctor_analysis.analyzers.gpu_metrics import compute_gpu_metrics
from stepdoctor_analysis.model.steps import find_steps
from stepdoctor_analysis.model.trace import RankTrace, Step
from stepdoctor_analysis.parsing import load_trace
from support.fixtures import CPU_FIXTURES, GPU_FIXTURES, parsed, write_trace

US = 1000  # ns per µs


def step(n: int, ts: float, dur: float) -> dict[str, Any]:
    return {
        "ph": "X",
        "cat": "user_annotation",
        "name": f"ProfilerStep#{n}",
        "pid": 1,
        "tid": 1,
        "ts": ts,
        "dur": dur,
    }


def op(ts: float, dur: float, name: str = "aten::add", cat: str = "cpu_op") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": {}}


def launch(ts: float, dur: float, corr: int, name: str = "cudaLaunchKernel") -> dict[str, Any]:
    return {
        "ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
        "args": {"correlation": corr, "External id": corr},
    }  # fmt: skip


def gpu(
    ts: float,
    dur: float,
    corr: int,
    name: str = "gemm",
    cat: str = "kernel",
    stream: int = 7,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
        "args": {"correlation": corr, "stream": stream, "device": 0, **(extra or {})},
    }  # fmt: skip


def trace(tmp_path: Path, events: list[dict[str, Any]]) -> RankTrace:
    return load_trace(write_trace(tmp_path / "t.json", events, deviceProperties=[{"id": 0, "name": "GPU"}]))


# ----------------------------------------------------------------------------------- steps


def test_step_end_follows_its_gpu_work_and_next_step_starts_after_it(tmp_path: Path) -> None:
    events = [
        step(1, 0, 100), launch(10, 5, 1), gpu(150, 100, 1),
        step(2, 100, 100), launch(120, 5, 2), gpu(260, 40, 2),
        step(3, 200, 100), launch(290, 20, 3), gpu(400, 10, 3),  # call ends after the step: not counted
        step(4, 300, 100),
    ]  # fmt: skip
    steps = find_steps(trace(tmp_path, events))
    # Step 3 and 4 launch nothing inside their ranges: trailing steps without GPU work are dropped.
    assert steps == [Step(1, 0, 250 * US), Step(2, 250 * US, 300 * US)]


def test_last_step_with_too_few_kernels_is_dropped(tmp_path: Path) -> None:
    events = [step(1, 0, 100), step(2, 100, 100)]
    events += [launch(10 + i, 1, i) for i in range(5)] + [gpu(20 + i * 2, 1, i) for i in range(5)]
    events += [launch(110 + i, 1, 10 + i) for i in range(3)] + [gpu(120 + i * 2, 1, 10 + i) for i in range(3)]
    assert [s.number for s in find_steps(trace(tmp_path, events))] == [1]  # 3 < 0.8 × 5
    events += [launch(150, 1, 20), gpu(160, 1, 20)]
    assert [s.number for s in find_steps(trace(tmp_path, events))] == [1, 2]  # 4 ≥ 0.8 × 5


def test_first_step_starts_after_gpu_work_launched_before_it(tmp_path: Path) -> None:
    events = [launch(0, 5, 9), gpu(10, 30, 9), step(1, 20, 30), launch(25, 5, 1), gpu(45, 10, 1)]
    assert find_steps(trace(tmp_path, events)) == [Step(1, 40 * US, 55 * US)]


def test_without_markers_one_step_spans_all_activity(tmp_path: Path) -> None:
    events = [op(10, 10), launch(12, 3, 1), gpu(30, 20, 1), op(5, 1, "Trace span", cat="Trace")]
    assert find_steps(trace(tmp_path, events)) == [Step(0, 10 * US, 50 * US)]
    cpu_only = parsed("rank_non_gpu/rank_non_gpu.json.gz")
    assert [s.number for s in find_steps(cpu_only)] == [1009]


@pytest.mark.parametrize("rel", GPU_FIXTURES + CPU_FIXTURES)
def test_fixture_steps_are_ordered_and_parts_sum_to_step_time(rel: str) -> None:
    tr = parsed(rel)
    steps = find_steps(tr)
    assert steps
    for a, b in itertools.pairwise(steps):
        assert a.end <= b.start and a.number < b.number
    bd = compute_breakdown(tr, steps)
    for s, parts in zip(steps, bd.per_step, strict=True):
        assert set(parts) == set(CATEGORIES)
        assert min(parts.values()) >= 0
        assert sum(parts.values()) == s.end - s.start
    avg = bd.average_us()
    assert avg["kernel"] == pytest.approx(np.mean([p["kernel"] for p in bd.per_step]) / US)
    assert sum(bd.shares().values()) == pytest.approx(1.0)


# ------------------------------------------------------------------------------- breakdown


def test_categories_claim_time_in_priority_order(tmp_path: Path) -> None:
    events = [
        step(1, 0, 100),
        launch(0, 15, 1), gpu(10, 20, 1),  # runtime 0-15, kernel 10-30
        launch(16, 1, 2), gpu(20, 20, 2, name="Memcpy HtoD (Pageable -> Device)", cat="gpu_memcpy"),  # 20-40
        op(50, 20, "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", cat="user_annotation"),
        op(60, 20),  # cpu op 60-80, 70-80 left after the DataLoader
        launch(81, 1, 3), gpu(85, 10, 3, name="ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
    ]  # fmt: skip
    tr = trace(tmp_path, events)
    steps = find_steps(tr)
    assert steps == [Step(1, 0, 100 * US)]
    parts = compute_breakdown(tr, steps).per_step[0]
    assert {k: v // US for k, v in parts.items()} == {
        "kernel": 20, "memcpy": 10, "memset": 0, "communication": 10,
        "runtime": 11,  # 0-10 (the kernel took 10-15), 81-82; 16-17 lies under the kernel
        "dataloader": 20, "cpu_exec": 10, "other": 19,
    }  # fmt: skip


def test_collective_ops_and_their_kernels_count_as_communication(tmp_path: Path) -> None:
    events = [
        step(1, 0, 100),
        op(10, 30, "nccl:all_to_all", cat="user_annotation") | {"args": {"External id": 5}},
        {**launch(12, 2, 1), "args": {"correlation": 1, "External id": 5}},
        gpu(50, 20, 1, name="some_collective_kernel"),  # linked to the collective by external id
    ]
    tr = trace(tmp_path, events)
    parts = compute_breakdown(tr, find_steps(tr)).per_step[0]
    assert parts["communication"] == (30 + 20) * US and parts["kernel"] == 0


def test_dataloader_time_is_found_in_real_traces() -> None:
    tr = parsed("trace_diff/control/control.json.gz")
    bd = compute_breakdown(tr, find_steps(tr))
    assert sum(p["dataloader"] for p in bd.per_step) > 0


# ----------------------------------------------------------------------------- GPU metrics


def test_gpu_utilization_sm_efficiency_and_occupancy(tmp_path: Path) -> None:
    events = [
        step(1, 0, 100), step(2, 100, 100),
        launch(1, 1, 1), gpu(0, 100, 1, extra={"blocks per SM": 0.6, "est. achieved occupancy %": 50}),
        launch(2, 1, 2), gpu(0, 100, 2, stream=8, extra={"blocks per SM": 0.6, "est. achieved occupancy %": 30}),
        launch(101, 1, 3), gpu(100, 50, 3, name="Memcpy DtoD (Device -> Device)", cat="gpu_memcpy"),
        launch(102, 1, 4), gpu(150, 50, 4, extra={"blocks per SM": 0.2, "est. achieved occupancy %": 10}),
    ]  # fmt: skip
    tr = trace(tmp_path, events)
    m = compute_gpu_metrics(tr, find_steps(tr), per_step=True)
    assert not compute_gpu_metrics(tr, find_steps(tr)).devices[0].per_step  # opt-in
    (dev,) = m.devices
    assert dev.device == 0
    assert dev.overall.utilization == pytest.approx(150 / 200)  # memcpy time is not utilization
    assert dev.overall.sm_efficiency == pytest.approx((100 * 1.0 + 50 * 0.2) / 200)  # 1.2 capped at 1
    assert dev.overall.occupancy == pytest.approx((50 * 100 + 30 * 100 + 10 * 50) / 250)
    assert [w.utilization for w in dev.per_step] == pytest.approx([1.0, 0.5])
    assert m.utilization == pytest.approx(0.75)


@pytest.mark.parametrize("rel", GPU_FIXTURES)
def test_gpu_metrics_bounds_on_real_traces(rel: str) -> None:
    tr = parsed(rel)
    m = compute_gpu_metrics(tr, find_steps(tr))
    assert m.devices
    for d in m.devices:
        assert 0 <= d.overall.utilization <= 1
        if d.overall.sm_efficiency is not None:
            assert 0 <= d.overall.sm_efficiency <= d.overall.utilization + 1e-9
        if d.overall.occupancy is not None:
            assert 0 <= d.overall.occupancy <= 100


# --------------------------------------------------------------------------- HTA metrics


def test_idle_time_is_split_into_host_kernel_and_other_wait(tmp_path: Path) -> None:
    events = [
        launch(-5, 1, 1), gpu(0, 10, 1),
        launch(20, 1, 2), gpu(25, 5, 2),  # launched after k1 ended: host wait 15
        launch(21, 1, 3), gpu(40, 5, 3),  # queued, gap 10 < 30: kernel wait 10
        launch(22, 1, 4), gpu(100, 5, 4),  # queued, gap 55: other
        launch(23, 1, 5), gpu(0, 5, 5, stream=9),
    ]  # fmt: skip
    idle = {s.stream: s for s in hm.idle_time_breakdown(trace(tmp_path, events))}
    assert (idle[7].host_wait_ns, idle[7].kernel_wait_ns, idle[7].other_ns) == (15 * US, 10 * US, 55 * US)
    assert idle[7].ratio("other") == pytest.approx(55 / 80)
    assert idle[9].idle_ns == 0


def test_temporal_breakdown_and_new_nccl_kernel_names(tmp_path: Path) -> None:
    events = [
        launch(0, 1, 1), gpu(0, 10, 1),
        launch(1, 1, 2), gpu(20, 10, 2, name="ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
        launch(2, 1, 3), gpu(40, 10, 3, name="Memset (Device)", cat="gpu_memset"),
    ]  # fmt: skip
    tb = hm.temporal_breakdown(trace(tmp_path, events))
    assert (tb.total_ns, tb.idle_ns, tb.compute_ns, tb.non_compute_ns) == (50 * US, 20 * US, 10 * US, 20 * US)
    assert hm.is_communication_kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL")
    assert hm.is_communication_kernel("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)")
    assert not hm.is_compute_kernel("ncclDevKernel_SendRecv")


def test_kernel_launch_statistics(tmp_path: Path) -> None:
    events = [
        launch(0, 10, 1), gpu(30, 2, 1),  # delay 20, short (2 < 10)
        launch(1, 60, 2), gpu(70, 5, 2),  # runtime outlier (60 > 50), delay 9
        launch(2, 5, 3), gpu(300, 50, 3),  # delay 293: outlier
    ]  # fmt: skip
    st = hm.kernel_launch_stats(trace(tmp_path, events))
    assert st.count == 3
    assert st.launch_delay_ns["max"] == 293 * US and st.launch_delay_ns["p50"] == 20 * US
    assert (st.short_kernels, st.runtime_outliers, st.launch_delay_outliers) == (1, 1, 1)
    (q,) = st.queues
    assert q.stream == 7 and q.max_length == 3


@pytest.mark.parametrize("rel", GPU_FIXTURES)
def test_hta_metrics_run_on_real_traces(rel: str) -> None:
    tr = parsed(rel)
    tb = hm.temporal_breakdown(tr)
    assert tb.total_ns > 0
    assert tb.idle_ns + tb.compute_ns + tb.non_compute_ns == tb.total_ns
    assert min(tb.idle_ns, tb.compute_ns, tb.non_compute_ns) >= 0
    st = hm.kernel_launch_stats(tr)
    assert st.count > 0 and st.launch_delay_ns["p50"] >= 0
    assert all(q.max_length >= 1 for q in st.queues)
