"""Two-process parsing (``parsing.forked``): the trace it builds is the one a single process builds,
column for column, and whatever it cannot share is parsed by one process, with the same result or
the same error."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stepdoctor_analysis.errors import TraceError
from stepdoctor_analysis.model.trace import RankTrace
from stepdoctor_analysis.parsing import forked, forking, load_trace, reading, splitting, start_trace
from stepdoctor_analysis.parsing.assembly import assemble
from stepdoctor_analysis.parsing.reading import DEFAULT_MAX_BYTES
from support.fixtures import TRACES, write_trace
from support.fresh_process import analyze_fresh

FIXTURES = sorted(p for p in TRACES.rglob("*.json.gz") if p.stat().st_size > 40_000)


@pytest.fixture
def many_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small chunks and blocks, so even a small trace is cut into many chunks shared by both; two
    cores as far as ``forking.usable`` can tell, whatever this machine has."""
    monkeypatch.setattr(forking, "MIN_FILE_BYTES", 0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(splitting, "_CHUNK", 16 << 10)
    monkeypatch.setattr(reading, "_OUT_BLOCK", 16 << 10)
    monkeypatch.setattr(reading, "_SMALL_FILE", 0)


def _shared(path: Path) -> RankTrace | None:
    b = forking.Started(path, DEFAULT_MAX_BYTES, path.name, str(path)).finish()
    return None if b is None else assemble(b)


def _assert_same(a: Any, b: Any, where: str = "trace") -> None:
    """Every field equal: arrays by dtype and value (NaN equal to NaN), the rest by ``==``."""
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, where
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), where
    else:
        assert a == b, where


@pytest.mark.usefixtures("many_chunks")
@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: str(p.relative_to(TRACES)))
def test_every_fixture_parsed_by_two_processes_is_the_single_process_trace(path: Path) -> None:
    alone = load_trace(path)
    shared = _shared(path)
    assert shared is not None, "the fixture was not shared between two processes"
    _assert_same(alone, shared)


def _ops(n: int, **extra: Any) -> list[dict[str, Any]]:
    return [
        {"ph": "X", "cat": "cpu_op", "name": f"op{i % 13}", "pid": 10, "tid": 20 + i % 2, "ts": 10 + i,
         "dur": 1, "args": {"External id": i}, **extra}
        for i in range(n)
    ]  # fmt: skip


@pytest.mark.usefixtures("many_chunks")
def test_names_values_and_op_args_first_seen_in_the_childs_chunks_keep_file_order(tmp_path: Path) -> None:
    """Names new in each chunk (so each process numbers them its own way), string args (collective
    names), matmul input types and flow-recovered correlations all come out as one process numbers them."""
    events: list[dict[str, Any]] = []
    for chunk in range(12):
        for i in range(150):
            k = chunk * 150 + i
            events.append({"ph": "X", "cat": "cpu_op", "name": f"op{chunk}_{i % 5}", "pid": 1, "tid": 1,
                           "ts": 10 * k, "dur": 2, "args": {"External id": k}})  # fmt: skip
        events.append({"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": 1, "tid": 1,
                       "ts": 10 * k + 1, "dur": 1,
                       "args": {"Collective name": f"coll{chunk % 4}", "dtype": "Float"}})  # fmt: skip
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10 * k + 2,
                       "dur": 1, "args": {"Input type": ["float", "c10::BFloat16"][chunk % 2:]}})  # fmt: skip
        events.append({"ph": "X", "cat": "kernel", "name": f"kernel{chunk}", "pid": 0, "tid": 7,
                       "ts": 10 * k + 3, "dur": 1, "args": {"correlation": chunk, "stream": 7}})  # fmt: skip
    path = write_trace(tmp_path / "names.json", events)
    alone, shared = load_trace(path), _shared(path)
    assert shared is not None
    _assert_same(alone, shared)
    assert alone.strings.index("op11_0") > alone.strings.index("op1_0")  # numbered in file order


@pytest.mark.usefixtures("many_chunks")
def test_label_pids_and_flow_ids_in_both_processes_chunks_get_the_single_process_ids(tmp_path: Path) -> None:
    """String pid/tid labels ("Spans") and string flow ids get negative ids in order of first
    appearance; each process numbers its own, and the merge gives them the file's order."""
    events = _ops(3000)
    for i in range(0, 3000, 250):
        events[i] = {**events[i], "pid": "Spans", "tid": f"window {i}"}
    for i in range(40, 3000, 300):  # an old trace's launch flows, their ids written as hex strings
        events.insert(i, {"ph": "X", "cat": "Kernel", "name": "k", "pid": 0, "tid": f"stream {i % 3}",
                          "ts": 10 + i, "dur": 1})  # fmt: skip
        events.insert(i, {"ph": "f", "cat": "async", "id": hex(i), "name": "launch", "pid": 0,
                          "tid": f"stream {i % 3}", "ts": 10 + i, "bp": "e"})  # fmt: skip
    path = write_trace(tmp_path / "labels.json", events)
    alone, shared = load_trace(path), _shared(path)
    assert shared is not None
    _assert_same(alone, shared)
    assert len(set(alone.host.tid[alone.host.tid < -1].tolist())) == 12
    assert (alone.gpu.correlation != -1).all()  # the flows were read (their ids are labels too)


@pytest.mark.usefixtures("many_chunks")
def test_a_cut_the_child_made_inside_a_name_falls_back_to_one_process(tmp_path: Path) -> None:
    """Each process cuts the other's chunks without decoding them: a name holding ``}, {`` makes the
    owner of that chunk refuse the cut, and the file is parsed by one process, which gets it right."""
    events = [{**e, "name": e["name"] + "}, {" + "x" * 300} for e in _ops(2000)]
    path = write_trace(tmp_path / "tricky.json", events)
    assert _shared(path) is None
    _assert_same(load_trace(path), load_trace(path, workers=2))


@pytest.mark.usefixtures("many_chunks")
def test_a_bad_event_late_in_the_file_gives_the_single_process_error(tmp_path: Path) -> None:
    """The event number in the message counts every event, not just one process's."""
    events = _ops(4000)
    events[3500] = {k: v for k, v in events[3500].items() if k != "dur"}
    path = write_trace(tmp_path / "bad.json", events)
    with pytest.raises(TraceError) as alone:
        load_trace(path)
    with pytest.raises(TraceError) as shared:
        load_trace(path, workers=2)
    assert str(shared.value) == str(alone.value)
    assert "event #3500" in str(alone.value)


@pytest.mark.usefixtures("many_chunks")
def test_out_of_memory_rows_past_the_kept_count_are_parsed_by_one_process(tmp_path: Path) -> None:
    events = _ops(3000)
    for i in range(0, 3000, 30):
        events.insert(i, {"ph": "i", "s": "t", "cat": "cpu_instant_event", "name": "[OutOfMemory]", "pid": 10,
                          "tid": 20, "ts": 10 + i, "args": {"Bytes": 1 << 20, "Device Id": 0,
                          "Device Type": 1, "Total Allocated": 1 << 30, "Total Reserved": 1 << 31}})  # fmt: skip
    path = write_trace(tmp_path / "ooms.json", events)
    assert _shared(path) is None
    alone = load_trace(path)
    _assert_same(alone, load_trace(path, workers=2))
    assert alone.out_of_memory == 100


@pytest.mark.usefixtures("many_chunks")
def test_a_refused_fork_leaves_the_file_to_one_process_and_no_descriptor_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No memory or too many processes: the fork fails, and the trace is parsed alone, not refused."""
    path = write_trace(tmp_path / "t.json", _ops(3000))
    alone = load_trace(path)

    def refused() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", refused)
    open_before = set(os.listdir("/proc/self/fd"))
    assert start_trace(path) is None
    _assert_same(alone, load_trace(path, workers=2))
    assert set(os.listdir("/proc/self/fd")) == open_before  # the pipe and shared files were closed


@pytest.mark.usefixtures("many_chunks")
def test_only_fork_safe_threads_allow_a_fork(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_trace(tmp_path / "t.json", _ops(10))
    assert forking.usable(path)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not forking.usable(path)
        setattr(other, forking.FORK_SAFE, True)
        assert forking.usable(path)
    finally:
        stop.set()
        other.join()
    monkeypatch.setattr(forking, "MIN_FILE_BYTES", path.stat().st_size + 1)
    assert not forking.usable(path)


@pytest.mark.usefixtures("many_chunks")
def test_a_parser_started_ahead_decodes_the_chunks_the_busy_parent_has_not_reached(tmp_path: Path) -> None:
    """``start_trace`` forks the child before the caller's other work (the CLI's imports): each
    chunk goes to whichever process reaches it first, so the child takes those the parent has not
    reached. Loading with it gives the single-process trace, and the child is collected; one never
    loaded is collected by ``cancel``."""
    path = TRACES / "hta" / "trace_diff" / "control" / "control.json.gz"
    started = start_trace(path)
    assert started is not None
    pid = started.pid
    deadline = time.monotonic() + 120
    while int.from_bytes(started.claims.next[:8], "little") < 5:  # the parent is busy elsewhere
        assert time.monotonic() < deadline, "the child claimed no chunks"
        time.sleep(0.01)
    _assert_same(load_trace(path), load_trace(path, started=started))
    parent, child = started.shares
    assert child >= 5 and parent >= 1  # the parent decodes the tail at least
    assert started.pid is None
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # collected: no zombie left
    unused = start_trace(path)
    assert unused is not None
    pid = unused.pid
    unused.cancel()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    other = write_trace(tmp_path / "other.json", _ops(500))
    mismatched = start_trace(path)
    assert mismatched is not None
    _assert_same(load_trace(other), load_trace(other, started=mismatched))  # not this file's: ignored
    mismatched.cancel()


def test_the_cli_report_is_the_same_with_one_process_or_two() -> None:
    """``stepdoctor analyze`` forks the second parser before importing the analysis; ``--jobs 1``
    parses in one process. The report is the same, byte for byte."""
    trace = TRACES / "hta" / "df_index_resolver" / "df_index_resolver.json.gz"
    if not forking.usable(trace):
        pytest.skip("one process parses here either way (not Linux, or one core)")

    def report(*extra: str) -> bytes:
        done = subprocess.run(
            [sys.executable, "-m", "stepdoctor.cli", "analyze", "--format", "json", *extra, str(trace)],
            capture_output=True,
            timeout=300,
            check=True,
        )
        return done.stdout

    assert report() == report("--jobs", "1")


def test_the_cli_forks_before_numpy_and_the_parser_are_imported() -> None:
    """The fork comes first (``parsing.forking`` is standard library only): each process then
    imports numpy and the parser on its own core, the child's imports beside the parent's."""
    trace = TRACES / "hta" / "df_index_resolver" / "df_index_resolver.json.gz"
    if not forking.usable(trace):
        pytest.skip("one process parses here either way (not Linux, or one core)")
    before = (
        "from stepdoctor_analysis.parsing import forking\n"
        "seen = []\n"
        "start = forking.Started.__init__\n"
        "def noted(self, *a, **k):\n"
        "    seen.append(sorted(m for m in ('numpy', 'msgspec', 'stepdoctor_analysis.parsing.columns')"
        " if m in sys.modules))\n"
        "    start(self, *a, **k)\n"
        "forking.Started.__init__ = noted"
    )
    assert analyze_fresh(trace, before=before, after="print(seen)") == "[[]]"  # forked once, before them


@pytest.mark.usefixtures("many_chunks")
def test_the_cli_collects_its_started_parser_when_the_analysis_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """``stepdoctor analyze`` forks before the analysis runs; a failure before the trace loads (here
    an interrupt) still ends and collects the child: no process left parsing, no zombie."""
    from stepdoctor_analysis import parsing, pipeline
    from stepdoctor_analysis.cli import analyze as analyze_cli

    pids: list[int | None] = []

    def start_and_note(*args: Any, **kwargs: Any) -> forking.Started | None:
        got = start_trace(*args, **kwargs)
        pids.append(got.pid if got else None)
        return got

    def interrupted(*_args: Any, **_kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(parsing, "start_trace", start_and_note)
    monkeypatch.setattr(pipeline, "analyze_path", interrupted)
    path = TRACES / "hta" / "trace_diff" / "control" / "control.json.gz"
    with pytest.raises(KeyboardInterrupt):
        analyze_cli.main(["--format", "json", str(path)])
    assert len(pids) == 1 and pids[0] is not None  # the child was forked
    with pytest.raises(ChildProcessError):
        os.waitpid(pids[0], os.WNOHANG)  # and collected


def test_the_childs_arrays_cross_through_the_shared_file_and_a_short_file_is_refused() -> None:
    """The child writes its arrays into the shared columns file (streamed chunk by chunk, the rest at
    the end) and pickles only their places; the parent maps them back, record dtypes and 2-D shapes
    included. A file shorter than the state says (the child died while writing) is no state."""
    columns, short = os.memfd_create("test-columns"), os.memfd_create("test-short")
    read_end, write_end = os.pipe()
    try:
        out = forked._ColumnsFile(columns)
        record = np.zeros(3, np.dtype([("ts", np.float64), ("pid", np.int64)]))
        record["ts"] = [1.5, 2.5, 3.5]
        streamed = out.store(np.arange(5, dtype=np.int32))  # stored as its chunk finished
        state = {"host": [{"ts": streamed}], "grid": np.arange(6.0).reshape(2, 3), "rec": record, "n": 7}
        forked._send(write_end, out, state)
        write_end = -1  # _send closed it
        got = forked._receive(read_end, columns)
        assert got is not None and got["n"] == 7
        assert got["host"][0]["ts"].tolist() == [0, 1, 2, 3, 4] and got["host"][0]["ts"].dtype == np.int32
        assert got["grid"].shape == (2, 3) and got["grid"][1, 2] == 5.0
        assert got["rec"].dtype == record.dtype and got["rec"]["ts"].tolist() == [1.5, 2.5, 3.5]
        got["grid"][0, 0] = -1.0  # writable, as the assembly needs: a private copy of the page
        # The same state again, its file cut short: refused rather than read past the end.
        os.close(read_end)
        read_end, write_end = os.pipe()
        forked._send(write_end, forked._ColumnsFile(short), {"big": np.arange(1 << 12)})
        write_end = -1
        os.ftruncate(short, 1024)
        assert forked._receive(read_end, short) is None
    finally:
        for fd in (read_end, write_end, columns, short):
            if fd >= 0:
                os.close(fd)
