"""The real Kineto traces the tests use, kept in the repository (provenance and licenses: tests/fixtures/traces/)."""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any

from stepdoctor_analysis.model.trace import RankTrace
from stepdoctor_analysis.parsing import load_trace

TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
TRACELENS_TRACES = TRACES / "tracelens"
HTA_TRACES = TRACES / "hta"

# Traces with GPU activity (kernels) that HTA and tb-profiler can both read.
GPU_FIXTURES = (
    "df_index_resolver/df_index_resolver.json.gz",
    "trace_diff/control/control.json.gz",
    "trace_diff/test/test.json.gz",
    "negative_queue_length_values_check/rank0.json.gz",
    "ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
    "nccl_parser_config/nccl_data.json.gz",
    "trace_filter/sampled_rank-0.json.gz",
    "trace_filter/sampled_rank-1.json.gz",
    "critical_path/simple_add/benchmark_result_493459_1694039959_trace.json.gz",
    "critical_path/cuda_event_sync/event_sync_trace.json.gz",
    "critical_path/cuda_event_sync_multi_stream/event_sync_trace.json.gz",
    "amd_trace/mi250_minitoy_train_ROCm6_2_kineto.json.gz",
    "triton_example/triton_example.json.gz",
    "trace_compare/base/base.json.gz",
    "trace_compare/test/test.json.gz",
    "trace_file_list/inference_rank_1.json.gz",
)
CPU_FIXTURES = (
    "cpu_only/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz",
    "rank_non_gpu/rank_non_gpu.json.gz",
)


def all_fixture_files() -> list[Path]:
    return sorted(HTA_TRACES.rglob("*.json.gz"))


def fixture(rel: str) -> Path:
    """Path of a repository fixture; a missing one is an error, never a skip."""
    p = HTA_TRACES / rel
    if not p.is_file():
        raise FileNotFoundError(f"fixture missing from the repository: {p}")
    return p


@functools.cache
def parsed(rel: str) -> RankTrace:
    """Each fixture is parsed once per test session, whichever test asks first."""
    return load_trace(fixture(rel))


def write_trace(path: Path, events: list[dict[str, Any]], **top: Any) -> Path:
    """Write a small Chrome trace (``.json`` or ``.json.gz`` by suffix) for a hand-built case."""
    body = json.dumps({**top, "traceEvents": events}).encode()
    path.write_bytes(gzip.compress(body) if path.name.endswith(".gz") else body)
    return path
