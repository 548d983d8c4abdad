"""Parser: every real fixture loads into a consistent columnar trace; bad input gives one clear line."""

from __future__ import annotations

import functools
import gzip
import json
import re
import zlib
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stepdoctor_analysis.errors import TraceError, TraceTooLarge
from stepdoctor_analysis.model.steps import launching_call
from stepdoctor_analysis.model.trace import NONE, CopyKind, GpuKind, HostKind, HostMem, RankTrace
from stepdoctor_analysis.parsing import load_job, load_trace, reading, splitting
from support.fixtures import (
    CPU_FIXTURES,
    GPU_FIXTURES,
    HTA_TRACES,
    all_fixture_files,
    fixture,
    parsed,
    write_trace,
)

GPU_CATS = {
    "kernel",
    "gpu_memcpy",
    "gpu_memset",
    "cuda_sync",
    "gpu_user_annotation",
    "Kernel",
    "Memcpy",
    "Memset",
}


@functools.cache
def raw_json(rel: str, exact: bool = False) -> dict[str, Any]:
    """The fixture read with the standard library: an independent view to check against.

    ``exact`` keeps the written decimals (``Decimal``) instead of rounding them to floats.
    """
    with gzip.open(fixture(rel)) as fh:
        return json.load(fh, parse_float=Decimal if exact else float)


def test_fixture_lists_cover_every_hta_trace() -> None:
    files = {str(p.relative_to(HTA_TRACES)) for p in all_fixture_files()}
    assert files == set(GPU_FIXTURES) | set(CPU_FIXTURES)


@pytest.mark.parametrize("rel", GPU_FIXTURES + CPU_FIXTURES)
def test_every_fixture_parses_consistently(rel: str) -> None:
    tr = parsed(rel)
    n_strings = len(tr.strings)
    for table in (tr.host, tr.gpu):
        assert np.all(np.diff(table.ts) >= 0), "tables are sorted by start time"
        assert np.all(table.dur >= 0)
        if len(table):
            assert table.name.min() >= 0 and table.name.max() < n_strings
    assert len(tr.host) > 0
    if rel in GPU_FIXTURES:
        assert (tr.gpu.kind == GpuKind.KERNEL).any()
    else:
        assert len(tr.gpu) == 0


@pytest.mark.parametrize(
    "rel",
    [
        "nccl_parser_config/nccl_data.json.gz",
        "ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
        "trace_file_list/inference_rank_1.json.gz",
        "amd_trace/mi250_minitoy_train_ROCm6_2_kineto.json.gz",
    ],
)
def test_event_counts_and_times_match_the_json(rel: str) -> None:
    tr = parsed(rel)
    events = [e for e in raw_json(rel, exact=True)["traceEvents"] if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    assert len(tr.gpu) == len(gpu)
    assert len(tr.host) == len(events) - len(gpu)
    # Times: int64 ns equal to the written µs × 1000. Epoch-scale float µs only carry a 0.25 µs
    # resolution through any float64 JSON decoder, so half of that is the error we allow.
    want = sorted(int(Decimal(e["ts"]) * 1000) for e in gpu)
    assert max(abs(int(g) - w) for g, w in zip(tr.gpu.ts.tolist(), want, strict=True)) <= 125
    want_dur = sorted(int(Decimal(e["dur"]) * 1000) for e in events)
    got_dur = sorted(np.concatenate([tr.host.dur, tr.gpu.dur]).tolist())
    assert max(abs(g - w) for g, w in zip(got_dur, want_dur, strict=True)) <= 1


def test_integer_microsecond_times_are_exact() -> None:
    rel = "trace_filter/sampled_rank-0.json.gz"
    tr = parsed(rel)
    kernels = [e for e in raw_json(rel)["traceEvents"] if e.get("cat") == "kernel"]
    want = sorted(int(e["ts"]) * 1000 for e in kernels)
    got = np.sort(tr.gpu.ts[tr.gpu.kind == GpuKind.KERNEL]).tolist()
    assert got == want


def test_metadata_rank_devices_and_memory_events() -> None:
    df = parsed("df_index_resolver/df_index_resolver.json.gz")
    assert (df.rank, df.world_size) == (1, 2)
    assert df.distributed["backend"] == "nccl"
    assert len(df.devices) == 2 and df.devices[0].name == "Tesla V100-SXM2-32GB"
    assert df.devices[0].total_memory > 30 * 2**30 and df.devices[0].num_sms == 80
    # The only fixture with [memory] events: check them against the raw text (regex, not our parser).
    text = gzip.decompress(fixture("df_index_resolver/df_index_resolver.json.gz").read_bytes())
    assert len(df.memory) == text.count(b'"name": "[memory]"') == 28010
    assert int(df.memory.bytes.sum()) == sum(int(b) for b in re.findall(rb'"Bytes": (-?\d+)', text))
    assert set(np.unique(df.memory.device_type).tolist()) <= {0, 1}
    assert df.memory.total_allocated.max() == max(
        int(b) for b in re.findall(rb'"Total Allocated": (\d+)', text)
    )

    amd = parsed("amd_trace/mi250_minitoy_train_ROCm6_2_kineto.json.gz")
    assert amd.rank is None and amd.world_size is None
    assert "baseTimeNanoseconds" in amd.metadata
    cpu = parsed("cpu_only/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz")
    assert (cpu.rank, cpu.world_size, cpu.devices, cpu.has_gpu) == (34, 300, [], False)


def test_categories_of_every_generation_are_recognised() -> None:
    legacy = parsed("trace_file_list/inference_rank_1.json.gz")
    assert legacy.format == "legacy-2021"
    assert set(legacy.host.kind.tolist()) == {HostKind.RUNTIME, HostKind.OTHER}  # OTHER: the "Trace" span
    assert (launching_call(legacy) >= 0).all()
    triton = parsed("triton_example/triton_example.json.gz")
    drivers = triton.host.kind == HostKind.DRIVER
    assert [triton.strings[n] for n in triton.host.name[drivers]] == ["cuLaunchKernel"]
    assert launching_call(triton).tolist() == [int(np.flatnonzero(drivers)[0])]
    amd = parsed("amd_trace/mi250_minitoy_train_ROCm6_2_kineto.json.gz")
    runtime_names = {amd.strings[n] for n in amd.host.name[amd.host.kind == HostKind.RUNTIME]}
    assert "hipLaunchKernel" in runtime_names
    # Kineto's ac2g flows and the older async_cpu_to_gpu ones both come with correlation ids.
    for rel in ("df_index_resolver/df_index_resolver.json.gz", "trace_diff/control/control.json.gz"):
        tr = parsed(rel)
        ops = np.isin(tr.gpu.kind, (GpuKind.KERNEL, GpuKind.MEMCPY, GpuKind.MEMSET))
        assert (launching_call(tr)[ops] >= 0).mean() > 0.99


def test_memcpy_direction_and_host_memory_from_names() -> None:
    tr = parsed("negative_queue_length_values_check/rank0.json.gz")
    copies = tr.gpu.kind == GpuKind.MEMCPY
    tags = {"HtoD": CopyKind.HTOD, "DtoH": CopyKind.DTOH, "DtoD": CopyKind.DTOD}
    seen = set()
    for i in np.flatnonzero(copies):
        name = tr.strings[tr.gpu.name[i]]
        want = next(k for tag, k in tags.items() if tag in name)
        assert tr.gpu.copy_kind[i] == want
        seen.add(want)
        mem = tr.gpu.host_mem[i]
        if want == CopyKind.DTOD:
            assert mem == HostMem.NONE
        else:
            assert mem == (HostMem.PAGEABLE if "Pageable" in name else HostMem.PINNED)
    assert seen == set(tags.values())
    assert (tr.gpu.copy_kind[~copies] == CopyKind.NONE).all()
    assert (tr.gpu.bytes[copies] > 0).all()


def test_load_job_reads_a_directory_sorted_by_rank(tmp_path: Path) -> None:
    src = fixture("trace_filter/sampled_rank-0.json.gz").parent
    # Names sorting opposite to rank order prove the sort uses distributedInfo.
    (tmp_path / "a.json.gz").write_bytes((src / "sampled_rank-1.json.gz").read_bytes())
    (tmp_path / "b.json.gz").write_bytes((src / "sampled_rank-0.json.gz").read_bytes())
    (tmp_path / "notes.txt").write_text("ignored")
    job = load_job(tmp_path)
    assert [t.rank for t in job] == [0, 1]
    assert [Path(t.source).name for t in job] == ["b.json.gz", "a.json.gz"]
    assert [t.rank for t in load_job(src)] == [0, 1]
    assert len(load_job(src / "sampled_rank-1.json.gz")) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match="empty: directory holds no"):
        load_job(empty)


def _same(a: RankTrace, b: RankTrace) -> None:
    assert a.strings == b.strings or sorted(a.strings) == sorted(b.strings)
    for ta, tb in ((a.host, b.host), (a.gpu, b.gpu), (a.memory, b.memory)):
        assert len(ta) == len(tb)
        np.testing.assert_array_equal(ta.ts, tb.ts)
    sa, sb = np.array(a.strings), np.array(b.strings)
    np.testing.assert_array_equal(sa[a.gpu.name], sb[b.gpu.name])
    np.testing.assert_array_equal(a.gpu.correlation, b.gpu.correlation)
    np.testing.assert_array_equal(a.host.external_id, b.host.external_id)


@pytest.fixture(params=["isal", "zlib"])
def inflate_lib(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run with ISA-L (the [analyze] extra) and with the stdlib zlib it falls back to."""
    if request.param == "zlib":
        monkeypatch.setattr(reading, "_inflate_lib", zlib)
    else:
        assert reading._inflate_lib.__name__.startswith("isal"), "the [analyze] extra installs isal"
    return str(request.param)


def test_small_chunks_one_line_json_and_multi_member_gzip_give_the_same_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inflate_lib: str
) -> None:
    rel = "trace_filter/sampled_rank-0.json.gz"
    ref = parsed(rel)
    data = raw_json(rel)
    one_line = tmp_path / "one_line.json"
    one_line.write_text(json.dumps(data, separators=(",", ":")))
    plain = gzip.decompress(fixture(rel).read_bytes())
    members = tmp_path / "members.json.gz"
    half = len(plain) // 2
    members.write_bytes(gzip.compress(plain[:half]) + gzip.compress(plain[half:]))
    monkeypatch.setattr(splitting, "_CHUNK", 16 << 10)
    monkeypatch.setattr(reading, "_OUT_BLOCK", 10_000)
    monkeypatch.setattr(reading, "_SMALL_FILE", 0)  # many blocks, even for these small files
    _same(ref, load_trace(fixture(rel)))
    _same(ref, load_trace(one_line))
    _same(ref, load_trace(members))


def test_old_traces_get_correlation_from_flow_events(tmp_path: Path) -> None:
    events = [
        {"ph": "X", "cat": "Operator", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 100, "dur": 50},
        {"ph": "X", "cat": "Runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 110, "dur": 5},
        {"ph": "s", "cat": "async", "id": 77, "name": "launch", "pid": 1, "tid": 1, "ts": 110},
        {
            "ph": "f",
            "cat": "async",
            "id": 77,
            "name": "launch",
            "pid": 0,
            "tid": "stream 7",
            "ts": 160,
            "bp": "e",
        },
        {"ph": "X", "cat": "Kernel", "name": "k", "pid": 0, "tid": "stream 7", "ts": 160, "dur": 30},
    ]
    tr = load_trace(write_trace(tmp_path / "old.json", events))
    assert tr.format == "legacy-2021"
    assert tr.gpu.correlation.tolist() == [77]
    assert launching_call(tr).tolist() == [1]


def test_odd_value_types_are_coerced_not_fatal(tmp_path: Path) -> None:
    events = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 10, "dur": 2,
         "args": {"correlation": "5", "External id": None}},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": "20.5", "dur": 3,
         "args": {"correlation": 5, "stream": 7, "device": 0, "blocks per SM": [1]}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": 0, "tid": 7,
         "ts": 30, "dur": 3, "args": {"correlation": 6, "stream": "0x1f", "device": "1"}},
    ]  # fmt: skip
    tr = load_trace(write_trace(tmp_path / "odd.json", events))
    assert tr.host.correlation.tolist() == [5] and tr.host.external_id.tolist() == [-1]
    assert tr.gpu.ts.tolist() == [20_500, 30_000] and np.isnan(tr.gpu.blocks_per_sm[0])
    assert tr.gpu.stream.tolist() == [7, 31] and tr.gpu.device.tolist() == [0, 1]  # AMD writes hex streams
    assert launching_call(tr).tolist() == [0, -1]
    # Only the stream is odd: the typed fast path handles it without the untyped fallback.
    kernel = {**events[1], "ts": 20, "args": {"correlation": 5, "stream": 7, "device": 0}}
    amd_like = [{**events[2], "ts": 40}, kernel]
    tr = load_trace(write_trace(tmp_path / "amd.json", amd_like))
    assert tr.gpu.stream.tolist() == [7, 31] and tr.gpu.ts.tolist() == [20_000, 40_000]


def test_label_pids_in_one_chunk_keep_later_chunks_numeric(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a "Spans"-style label is seen, pid/tid are read apart from the numeric record."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "span", "pid": "Spans", "tid": "PyTorch Profiler",
               "ts": 1, "dur": 1}]  # fmt: skip
    events += [
        {"ph": "X", "cat": "cpu_op", "name": f"op{i % 7}", "pid": 10 + i % 3, "tid": 20 + i % 2, "ts": 10 + i,
         "dur": 1, "args": {"External id": i}}
        for i in range(3000)
    ]  # fmt: skip
    monkeypatch.setattr(splitting, "_CHUNK", 4 << 10)
    monkeypatch.setattr(reading, "_OUT_BLOCK", 4 << 10)
    monkeypatch.setattr(reading, "_SMALL_FILE", 0)
    tr = load_trace(write_trace(tmp_path / "labels.json", events))
    assert tr.host.pid[0] < -1 and tr.host.tid[0] < -1  # labels get negative ids
    assert tr.host.pid[1:].tolist() == [10 + i % 3 for i in range(3000)]
    assert tr.host.tid[1:].tolist() == [20 + i % 2 for i in range(3000)]
    assert tr.host.external_id[1:].tolist() == list(range(3000))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"this is not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b'{"foo": 1}', "no 'traceEvents' list"),
        (b'{"traceEvents": 5}', "no 'traceEvents' list"),
        (b"[1, 2]", "top level is not a JSON object"),
        (b'{"traceEvents": []}', "contains no events"),
        (b'{"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1}]}', "contains no events"),
        (b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "dur": 1}]}', "lacks 'ts'"),
        (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "a", "ts": 1}]}', "lacks 'dur'"),
        (b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "ts": 1, "dur": 1}]}', "lacks 'name'"),
        (b'{"traceEvents": [7]}', "malformed event"),
        (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 1}', "not valid JSON"),
    ],
)
def test_bad_json_gives_one_line_naming_the_file(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "upload.json"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=message) as err:
        load_trace(path)
    text = str(err.value)
    assert text.startswith("upload.json: ") and "\n" not in text


def test_truncated_and_corrupt_gzip(tmp_path: Path, inflate_lib: str) -> None:
    data = fixture("critical_path/simple_add/benchmark_result_493459_1694039959_trace.json.gz").read_bytes()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match=r"cut.json.gz: truncated gzip"):
        load_trace(cut)
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(data[:20] + bytes(200) + data[220:])
    with pytest.raises(TraceError, match=r"bad.json.gz: (corrupt gzip|truncated gzip)"):
        load_trace(bad)
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "missing.json.gz")


def test_gzip_bomb_stops_at_the_cap(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b'{"traceEvents": [' + b" " * (16 << 20) + b"]}", compresslevel=1))
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(
        TraceTooLarge, match=r"bomb.json.gz: decompressed trace exceeds the 1,048,576 byte limit"
    ):
        load_trace(bomb, max_bytes=1 << 20)
    plain = tmp_path / "big.json"
    plain.write_bytes(b" " * (2 << 20))
    with pytest.raises(TraceTooLarge, match="1,048,576 byte limit"):
        load_trace(plain, max_bytes=1 << 20)


@pytest.mark.parametrize("keep", [20, 5000])
def test_truncated_plain_json_says_truncated(tmp_path: Path, keep: int) -> None:
    raw = gzip.decompress(fixture("trace_compare/base/base.json.gz").read_bytes())
    assert len(raw) > keep
    cut = tmp_path / "cut.json"
    cut.write_bytes(raw[:keep])
    with pytest.raises(TraceError, match=r"cut.json: not valid JSON \(Input data was truncated\)"):
        load_trace(cut)


def test_flow_links_needed_partway_through_a_multi_chunk_trace(tmp_path: Path) -> None:
    """Correlation args on the first half only; the second half links launches to kernels by flows
    alone, so flow events skipped while decoding early chunks must be recovered for later ones."""
    events: list[dict[str, object]] = []
    pairs = 6000
    for i in range(pairs):
        t = 100.0 + i * 10
        legacy = i >= pairs // 2
        if legacy:
            events += [
                {
                    "ph": "X",
                    "cat": "Runtime",
                    "name": "cudaLaunchKernel",
                    "pid": 1,
                    "tid": 1,
                    "ts": t,
                    "dur": 3,
                },
                {
                    "ph": "X",
                    "cat": "Kernel",
                    "name": "k_legacy",
                    "pid": 0,
                    "tid": 7,
                    "ts": t + 5,
                    "dur": 2,
                    "args": {"device": 0, "stream": 7},
                },
                {"ph": "s", "cat": "async", "name": "launch", "id": 100_000 + i, "pid": 1, "tid": 1, "ts": t},
                {
                    "ph": "f",
                    "cat": "async",
                    "name": "launch",
                    "id": 100_000 + i,
                    "pid": 0,
                    "tid": 7,
                    "ts": t + 5,
                    "bp": "e",
                },
            ]
        else:
            events += [
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "pid": 1,
                    "tid": 1,
                    "ts": t,
                    "dur": 3,
                    "args": {"correlation": i + 1},
                },
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": "k_modern",
                    "pid": 0,
                    "tid": 7,
                    "ts": t + 5,
                    "dur": 2,
                    "args": {"correlation": i + 1, "device": 0, "stream": 7},
                },
            ]
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    assert path.stat().st_size > 4 * splitting._CHUNK  # several parser chunks

    trace = load_trace(path)
    gpu, host = trace.gpu, trace.host
    assert len(gpu) == pairs
    assert (gpu.correlation != NONE).all(), "every kernel must be linked to its launch"
    launch_ts = {int(c): int(t) for c, t in zip(host.correlation, host.ts, strict=True) if c != NONE}
    gaps = {int(t) - launch_ts[int(c)] for c, t in zip(gpu.correlation, gpu.ts, strict=True)}
    assert gaps == {5_000}, "each kernel starts 5 µs after the launch it belongs to"


def test_a_long_logs_array_after_the_events_is_not_mistaken_for_their_end(tmp_path: Path) -> None:
    """Kineto may write a "logs" array of CUPTI lines after the events, each with a ']' in it."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1, "ts": 1, "dur": 2}]
    top = {
        "schemaVersion": 1,
        "traceEvents": events,
        "logs": [f"INFO CuptiActivityProfiler.cpp:{i}] [Profiler = x] ok], [y]" for i in range(200)],
        "traceName": "t.json",
    }
    path = tmp_path / "logs.json"
    path.write_text(json.dumps(top, indent=1))
    tr = load_trace(path)
    assert len(tr.host) == 1 and tr.metadata.get("traceName", "t.json") == "t.json"


def test_name_tests_are_cached_across_traces_only_when_they_depend_on_the_name_alone(tmp_path: Path) -> None:
    """``RankTrace.host_named`` keeps the answers of stateless predicates (module functions, compiled
    patterns) per name across traces; a closure may answer differently next time, so it is asked again."""
    from stepdoctor_analysis.model.trace import _answers

    events = [
        {"ph": "X", "cat": "cpu_op", "name": n, "pid": 1, "tid": 1, "ts": i * 10, "dur": 5}
        for i, n in enumerate(["aten::mm", "aten::add", "aten::mm_x"])
    ]
    first = load_trace(write_trace(tmp_path / "a.json", events))
    second = load_trace(write_trace(tmp_path / "b.json", events))
    rx = re.compile(r"^aten::mm")
    assert _answers(rx.match) is not None and _answers(len) is None
    assert first.host_named(rx.match, "t.mm").tolist() == [True, False, True]
    cached = _answers(rx.match) or {}
    assert {n: cached.get(n) for n in ("aten::mm", "aten::add", "aten::mm_x")} == {
        "aten::mm": True,
        "aten::add": False,
        "aten::mm_x": True,
    }

    wanted = {"aten::add"}  # a closure over mutable state: never cached
    assert _answers(lambda s: s in wanted) is None
    assert first.host_named(lambda s: s in wanted, "t.closure").tolist() == [False, True, False]
    wanted.clear()
    wanted.add("aten::mm_x")
    assert second.host_named(lambda s: s in wanted, "t.closure").tolist() == [False, False, True]
