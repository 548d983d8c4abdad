"""Our numbers against the peers' own code on the real fixtures (anchors §2–3).

torch-tb-profiler 0.4.3 (step breakdown, GPU metrics) and HTA 0.5.0 (temporal and idle-time
breakdown) are run on the same files. Where we deliberately differ from tb-profiler, the trace handed
to it is normalised so that the shared algorithm is what gets compared:
- ``cuda_runtime``/``cuda_driver`` are renamed ``Runtime`` (0.4.3 only knows the legacy name, so on
  any PyTorch ≥ 1.10 trace it sees no launches at all and never extends steps to their GPU work);
- DataLoader ``user_annotation`` ranges are renamed ``cpu_op`` (0.4.3 drops annotations, reporting 0);
- every ``nccl:*`` op name in the trace joins its collective list (it knows only five);
- it finds NCCL kernels only through the collective's external id, we also by name; as communication
  ranks below memcpy/memset, GPU categories are compared as a sum, and ours may only be larger.
Traces without step markers are not compared: tb-profiler spans CPU ops only, we span all activity.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepdoctor_analysis.analyzers import hta_metrics as hm
from stepdoctor_analysis.analyzers.breakdown import CATEGORIES, compute_breakdown, is_dataloader_name
from stepdoctor_analysis.analyzers.gpu_metrics import compute_gpu_metrics
from stepdoctor_analysis.model.steps import find_steps, step_marker_mask
from support.fixtures import CPU_FIXTURES, GPU_FIXTURES, fixture, parsed

pytestmark = pytest.mark.slow

NO_MARKERS = {
    "critical_path/simple_add/benchmark_result_493459_1694039959_trace.json.gz",
    "critical_path/cuda_event_sync_multi_stream/event_sync_trace.json.gz",
    "trace_file_list/inference_rank_1.json.gz",
}
WITH_MARKERS = [r for r in GPU_FIXTURES + CPU_FIXTURES if r not in NO_MARKERS]


@pytest.fixture(autouse=True)
def _quiet_peers() -> Iterator[None]:
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def _tb_profile(rel: str, tmp_path: Path) -> Any:
    """tb-profiler's RunProfileData for a fixture; computed once per session (it is slow)."""
    if rel not in _TB_CACHE:
        _TB_CACHE[rel] = _run_tb_profiler(rel, tmp_path)
    return _TB_CACHE[rel]


_TB_CACHE: dict[str, Any] = {}


def _run_tb_profiler(rel: str, tmp_path: Path) -> Any:
    tb_trace = pytest.importorskip("torch_tb_profiler.profiler.trace")
    data_mod = pytest.importorskip("torch_tb_profiler.profiler.data")
    with gzip.open(fixture(rel)) as fh:
        data = json.load(fh)
    extra = []
    for e in data["traceEvents"]:
        cat, name = e.get("cat"), e.get("name", "")
        if cat in ("cuda_runtime", "cuda_driver"):
            e["cat"] = "Runtime"
        elif cat == "user_annotation" and is_dataloader_name(name):
            e["cat"] = "cpu_op"
        if name.startswith("nccl:") and name not in tb_trace.NcclOpNameSet and name not in extra:
            extra.append(name)
    path = tmp_path / "worker0.pt.trace.json"
    path.write_text(json.dumps(data))
    names = tb_trace.NcclOpNameSet  # the list event_parser imported: extend it in place, then restore
    names.extend(extra)
    try:
        return data_mod.RunProfileData.parse("worker0", None, str(path), str(tmp_path))
    finally:
        del names[len(names) - len(extra) :]


@pytest.mark.parametrize("rel", WITH_MARKERS)
def test_step_breakdown_matches_tb_profiler(rel: str, tmp_path: Path) -> None:
    role = pytest.importorskip("torch_tb_profiler.profiler.event_parser").ProfileRole
    prof = _tb_profile(rel, tmp_path)
    tr = parsed(rel)
    assert step_marker_mask(tr).any()
    steps = find_steps(tr)
    bd = compute_breakdown(tr, steps)
    assert [str(s.number) for s in steps] == prof.steps_names
    roles = {
        "kernel": role.Kernel, "memcpy": role.Memcpy, "memset": role.Memset, "communication": role.Communication,
        "runtime": role.Runtime, "dataloader": role.DataLoader, "cpu_exec": role.CpuOp, "other": role.Other,
    }  # fmt: skip
    for s, ours, theirs in zip(steps, bd.per_step, prof.steps_costs, strict=True):
        total_us = theirs.costs[role.Total]
        tol = 0.01 * total_us
        assert (s.end - s.start) / 1000 == pytest.approx(total_us, abs=tol)
        us = {c: ours[c] / 1000 for c in CATEGORIES}
        tb = {c: theirs.costs[roles[c]] for c in CATEGORIES}
        for c in ("runtime", "dataloader", "cpu_exec", "other"):
            assert us[c] == pytest.approx(tb[c], abs=tol), c
        # NCCL kernels are communication for us (priority after memcpy/memset), kernels for tb.
        device = ("kernel", "memcpy", "memset", "communication")
        assert sum(us[c] for c in device) == pytest.approx(sum(tb[c] for c in device), abs=tol)
        for c in ("memcpy", "memset", "communication"):
            assert us[c] >= tb[c] - tol, c


@pytest.mark.parametrize("rel", [r for r in WITH_MARKERS if r in GPU_FIXTURES])
def test_gpu_metrics_match_tb_profiler(rel: str, tmp_path: Path) -> None:
    gm = _tb_profile(rel, tmp_path).gpu_metrics_parser
    tr = parsed(rel)
    ours = compute_gpu_metrics(tr, find_steps(tr))
    assert sorted(d.device for d in ours.devices) == sorted(gm.gpu_ids)
    for d in ours.devices:
        assert d.overall.utilization == pytest.approx(gm.gpu_utilization[d.device], abs=0.01)
        want_sm = gm.avg_approximated_sm_efficiency_per_device[d.device]
        if want_sm is None:
            assert d.overall.sm_efficiency is None
        else:
            assert d.overall.sm_efficiency == pytest.approx(want_sm, abs=0.01)
        want_occ = gm.avg_occupancy_per_device[d.device]
        if want_occ is not None:
            assert d.overall.occupancy == pytest.approx(want_occ, abs=1.0)


@pytest.mark.parametrize("rel", sorted(NO_MARKERS))
def test_without_markers_we_span_at_least_tb_profilers_step(rel: str, tmp_path: Path) -> None:
    role = pytest.importorskip("torch_tb_profiler.profiler.event_parser").ProfileRole
    (step,) = find_steps(parsed(rel))
    total_us = _tb_profile(rel, tmp_path).steps_costs[0].costs[role.Total]
    # tb-profiler: first to last CPU op (garbage when there is none); ours also covers GPU work.
    assert (step.end - step.start) / 1000 >= min(total_us, (step.end - step.start) / 1000)
    assert step.number == 0


def _hta(rel: str, tmp_path: Path) -> tuple[Any, Any]:
    ta_mod = pytest.importorskip("hta.trace_analysis")
    shutil.copy(fixture(rel), tmp_path)
    analysis = ta_mod.TraceAnalysis(trace_dir=str(tmp_path))
    rank = next(iter(analysis.t.traces))
    temporal = analysis.get_temporal_breakdown(visualize=False)
    idle = analysis.get_idle_time_breakdown(ranks=[rank], visualize=False)[0]
    return temporal, idle


@pytest.mark.parametrize("rel", GPU_FIXTURES)
def test_temporal_and_idle_breakdown_match_hta(rel: str, tmp_path: Path) -> None:
    temporal, idle = _hta(rel, tmp_path)
    tr = parsed(rel)
    ours = hm.temporal_breakdown(tr)
    row = temporal.iloc[0]
    for part in ("idle", "compute", "non_compute"):
        assert ours.share(part) * 100 == pytest.approx(row[f"{part}_time_pctg"], abs=1.0), part
    streams = {s.stream: s for s in hm.idle_time_breakdown(tr)}
    assert set(streams) == {int(s) for s in idle["stream"]}
    for _, r in idle.iterrows():
        if math.isnan(r["idle_time_ratio"]):  # HTA's ratio for a stream without any idle time
            assert streams[int(r["stream"])].idle_ns == 0
            continue
        ratio = streams[int(r["stream"])].ratio(r["idle_category"])
        assert ratio * 100 == pytest.approx(r["idle_time_ratio"] * 100, abs=1.0), (
            r["stream"],
            r["idle_category"],
        )
