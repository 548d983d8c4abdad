"""Deep analyses through HTA (``stepdoctor_analysis.analyzers.deep``): critical path and trace diff.

Expectations are derived here from the raw Kineto JSON (spans, op durations, per-step name
multisets), never copied from our own output. The "HTA missing" case runs in a subprocess that
blocks the import.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from stepdoctor_analysis.analyzers import deep
from stepdoctor_analysis.cli import analyze as cli
from stepdoctor_analysis.errors import TraceError
from support.fixtures import HTA_TRACES

HTA = HTA_TRACES
CP = HTA / "critical_path"
SYNC = CP / "cuda_event_sync" / "event_sync_trace.json.gz"
CP_CASES = {
    "simple_add": CP / "simple_add",  # a directory holding one trace, no step markers
    "event_sync": SYNC,  # one ProfilerStep
    "multi_stream": CP / "cuda_event_sync_multi_stream" / "event_sync_trace.json.gz",
}
BASE = HTA / "trace_compare" / "base" / "base.json.gz"
OTHER = HTA / "trace_compare" / "test" / "test.json.gz"
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}

needs_hta = pytest.mark.skipif(not deep.available(), reason="HTA extra not installed")


def raw(path: Path) -> dict[str, Any]:
    f = path if path.is_file() else next(path.glob("*.json.gz"))
    with gzip.open(f) as fh:
        out: dict[str, Any] = json.load(fh)
    return out


def complete_events(path: Path) -> list[dict[str, Any]]:
    return [e for e in raw(path)["traceEvents"] if e.get("ph") == "X"]


@pytest.fixture(scope="module")
def cp_results() -> dict[str, dict[str, Any]]:
    if not deep.available():
        pytest.skip("HTA extra not installed")
    return {name: deep.critical_path(p) for name, p in CP_CASES.items()}


# --------------------------------------------------------------------------------------------------
# Critical path


@needs_hta
@pytest.mark.parametrize("case", sorted(CP_CASES))
def test_critical_path_length_within_trace_span_and_above_longest_op(
    case: str, cp_results: dict[str, dict[str, Any]]
) -> None:
    r = cp_results[case]
    events = complete_events(CP_CASES[case])
    span = max(e["ts"] + e.get("dur", 0) for e in events) - min(e["ts"] for e in events)
    assert 0 < r["length_us"] <= span + 1
    # The longest path of the event graph covers any single op's start→end chain.
    assert r["top"], "no ops on the path"
    assert r["length_us"] >= max(row["longest_event_us"] for row in r["top"])
    for row in r["top"]:
        durs = {e.get("dur") for e in events if e["name"] == row["name"]}
        assert row["longest_event_us"] in durs, row["name"]  # a real event of that name
        assert 0 < row["us"] <= r["length_us"]
        assert row["share"] == pytest.approx(row["us"] / r["length_us"])
    assert [row["us"] for row in r["top"]] == sorted((row["us"] for row in r["top"]), reverse=True)


@needs_hta
@pytest.mark.parametrize("case", sorted(CP_CASES))
def test_critical_path_breakdown_accounts_for_the_whole_path(
    case: str, cp_results: dict[str, dict[str, Any]]
) -> None:
    r = cp_results[case]
    assert list(r["breakdown"]) == list(deep.BOUND_TYPES)
    assert sum(r["breakdown"].values()) == pytest.approx(r["length_us"])
    assert sum(r["hta_breakdown"].values()) == pytest.approx(r["length_us"])  # our split keeps HTA's total
    assert sum(r["shares"].values()) == pytest.approx(1.0)
    # Our gpu_memory bucket is carved out of HTA's gpu_compute_bound, nothing else.
    gpu = r["breakdown"]["gpu_compute"] + r["breakdown"]["gpu_memory"]
    assert gpu == pytest.approx(r["hta_breakdown"].get("gpu_compute_bound", 0.0))
    copies = [
        row for row in r["top"] if row["device"] == "gpu" and row["name"].startswith(("Memcpy", "Memset"))
    ]
    assert r["breakdown"]["gpu_memory"] >= sum(row["us"] for row in copies)
    assert json.loads(json.dumps(r)) == r  # JSON-ready as is


@needs_hta
def test_step_is_reported_and_unknown_step_is_one_line(cp_results: dict[str, dict[str, Any]]) -> None:
    steps = [
        int(e["name"].split("#")[1]) for e in complete_events(SYNC) if e["name"].startswith("ProfilerStep#")
    ]
    assert (
        cp_results["event_sync"]["step"] == steps[0] and cp_results["event_sync"]["steps_available"] == steps
    )
    assert cp_results["simple_add"]["step"] is None  # no markers: the whole trace
    with pytest.raises(TraceError, match=r"no ProfilerStep#7\b") as err:
        deep.critical_path(SYNC, step=7)
    assert "\n" not in str(err.value)


@needs_hta
def test_explicit_step_selects_that_window() -> None:
    windows = {
        e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in complete_events(BASE) if "ProfilerStep" in e["name"]
    }
    first = deep.critical_path(BASE)
    last = deep.critical_path(BASE, step=1010)
    assert (first["step"], last["step"]) == (1009, 1010)  # two steps: the first, unless asked
    t0 = min(e["ts"] for e in complete_events(BASE))
    for r, name in ((first, "ProfilerStep#1009"), (last, "ProfilerStep#1010")):
        start, _ = windows[name]
        assert r["path_start_us"] >= start - t0 - 1  # HTA's times are relative to the first event


@needs_hta
def test_rankless_renamed_trace_works_and_rank_is_explicit(
    tmp_path: Path, cp_results: dict[str, dict[str, Any]]
) -> None:
    d = raw(SYNC)
    assert d.pop("distributedInfo")["rank"] == 0
    upload = tmp_path / "upload.bin"  # a stored upload: no suffix, gzip inside, no rank
    upload.write_bytes(gzip.compress(json.dumps(d, separators=(",", ":")).encode()))
    want = cp_results["event_sync"]
    for rank in (None, 3):
        r = deep.critical_path(upload, rank=rank)
        assert r["rank"] == (rank or 0)
        assert r["length_us"] == want["length_us"] and r["breakdown"] == want["breakdown"]
    with pytest.raises(TraceError, match="rank 0, not rank 2"):
        deep.critical_path(SYNC, rank=2)


@needs_hta
def test_rank_from_compact_json_and_from_a_directory(tmp_path: Path) -> None:
    d = raw(SYNC)
    d["distributedInfo"] = {"backend": "nccl", "rank": 2, "world_size": 4}
    compact = json.dumps(d, separators=(",", ":")).encode()  # HTA's own rank regex needs a space
    (tmp_path / "a.json").write_bytes(compact)
    assert deep.critical_path(tmp_path / "a.json")["rank"] == 2
    d["distributedInfo"]["rank"] = 1
    (tmp_path / "b.json.gz").write_bytes(gzip.compress(json.dumps(d).encode()))
    assert deep.critical_path(tmp_path)["rank"] == 1  # a directory: lowest rank unless asked
    assert deep.critical_path(tmp_path, rank=2)["source"] == "a.json"
    with pytest.raises(TraceError, match=r"no trace for rank 5 \(ranks found: \[1, 2\]\)"):
        deep.critical_path(tmp_path, rank=5)


def test_default_step_skips_warmup_and_the_possibly_cut_last_step() -> None:
    p = Path("t.json")
    assert deep._choose_step([], None, p) is None
    assert deep._choose_step([4], None, p) == 4
    assert deep._choose_step([4, 5], None, p) == 4
    assert deep._choose_step([4, 5, 6, 7], None, p) == 5
    assert deep._choose_step([4, 5, 6, 7], 7, p) == 7


@needs_hta
def test_cpu_time_inside_a_dataloader_fetch_is_data_loading(
    tmp_path: Path, cp_results: dict[str, dict[str, Any]]
) -> None:
    d = raw(SYNC)
    op = max((e for e in d["traceEvents"] if e.get("name") == "aten::empty"), key=lambda e: e["dur"])
    fetch = {
        "ph": "X", "cat": "user_annotation", "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
        "pid": op["pid"], "tid": op["tid"], "ts": op["ts"] - 1, "dur": op["dur"] + 2, "args": {},
    }  # fmt: skip
    d["traceEvents"].append(fetch)
    p = tmp_path / "loader.json"
    p.write_text(json.dumps(d))
    before, after = cp_results["event_sync"], deep.critical_path(p)
    assert before["breakdown"]["data_loading"] == 0
    assert op["dur"] <= after["breakdown"]["data_loading"] <= fetch["dur"]
    assert after["length_us"] == before["length_us"]
    moved = after["breakdown"]["cpu"] + after["breakdown"]["data_loading"]
    assert moved == pytest.approx(before["breakdown"]["cpu"])


@needs_hta
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda tmp: HTA / "rank_non_gpu" / "rank_non_gpu.json.gz", "no GPU activity"),
        (lambda tmp: tmp / "missing.json", "no such file"),
        (lambda tmp: _truncated(tmp), "unreadable trace"),
        (lambda tmp: _write(tmp / "x.json", "not json {"), "HTA could not run"),
    ],
)
def test_bad_input_is_one_line_trace_error(tmp_path: Path, make: Any, match: str) -> None:
    with pytest.raises(TraceError, match=match) as err:
        deep.critical_path(make(tmp_path))
    assert "\n" not in str(err.value)


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


def _truncated(tmp: Path) -> Path:
    data = SYNC.read_bytes()
    p = tmp / "cut.json.gz"
    p.write_bytes(data[: len(data) // 2])
    return p


# --------------------------------------------------------------------------------------------------
# Trace diff


def step_multisets(path: Path, step: int) -> tuple[Counter[str], Counter[str], dict[str, float]]:
    """(gpu names, cpu names, µs per name) of one step, by HTA's documented rule: host events by
    start time inside ``ProfilerStep#N``, device events by their launching runtime call."""
    events = complete_events(path)
    win = next((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == f"ProfilerStep#{step}")
    in_step = {
        e["args"]["correlation"]
        for e in events
        if e.get("cat") == "cuda_runtime"
        and win[0] <= e["ts"] < win[1]
        and "correlation" in e.get("args", {})
    }
    gpu: Counter[str] = Counter()
    cpu: Counter[str] = Counter()
    us: dict[str, float] = {}
    for e in events:
        if e["name"].startswith("ProfilerStep#"):
            continue
        if e.get("cat") in GPU_CATS:
            if e["args"].get("correlation") not in in_step:
                continue
            gpu[e["name"]] += 1
        elif win[0] <= e["ts"] < win[1]:
            cpu[e["name"]] += 1
        else:
            continue
        us[e["name"]] = us.get(e["name"], 0.0) + e["dur"]
    return gpu, cpu, us


@pytest.fixture(scope="module")
def diffs() -> dict[str, dict[str, Any]]:
    if not deep.available():
        pytest.skip("HTA extra not installed")
    return {
        "default": deep.trace_diff(BASE, OTHER),
        "1010": deep.trace_diff(BASE, OTHER, base_step=1010, other_step=1010),
    }


@needs_hta
@pytest.mark.parametrize("step", [1009, 1010])
def test_trace_diff_counts_match_name_multisets(step: int, diffs: dict[str, dict[str, Any]]) -> None:
    r = diffs["1010" if step == 1010 else "default"]  # two steps each: the default is the first
    assert r["base"]["step"] == r["other"]["step"] == step
    bg, bc, bus = step_multisets(BASE, step)
    og, oc, ous = step_multisets(OTHER, step)
    rows = {(row["device"], row["name"]): row for row in r["top"]}
    for device, b, o in (("gpu", bg, og), ("cpu", bc, oc)):
        names = set(b) | set(o)
        assert {n for d, n in rows if d == device} == names
        for n in names:
            row = rows[(device, n)]
            assert (row["base_count"], row["other_count"]) == (b[n], o[n]), n
            assert row["delta_us"] == pytest.approx(ous.get(n, 0.0) - bus.get(n, 0.0)), n
        s = r["summary"][device]
        assert s["added"] == sum(1 for n in names if not b[n])
        assert s["removed"] == sum(1 for n in names if not o[n])
        assert s["count_changed"] == sum(1 for n in names if b[n] and o[n] and b[n] != o[n])
        assert (s["base_count"], s["other_count"]) == (sum(b.values()), sum(o.values()))


@needs_hta
def test_trace_diff_sees_the_changed_step(diffs: dict[str, dict[str, Any]]) -> None:
    changed = diffs["1010"]
    # Derived above from the JSON: step 1010 of the other trace gained host ops and lost a kernel.
    assert changed["summary"]["cpu"]["added"] > 0 and changed["summary"]["gpu"]["removed"] > 0
    deltas = [abs(row["delta_us"]) for row in changed["top"]]
    assert deltas == sorted(deltas, reverse=True)


# --------------------------------------------------------------------------------------------------
# CLI


@needs_hta
def test_cli_deep_json_and_text(
    capsys: pytest.CaptureFixture[str], cp_results: dict[str, dict[str, Any]]
) -> None:
    assert cli.main([str(SYNC), "--deep", "critical-path", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    d = json.loads(out)  # nothing from HTA's logging on stdout
    assert all(line.startswith("stepdoctor: ") for line in err.splitlines()), err  # progress only
    assert "primary" in d and d["deep"]["analysis"] == "critical_path"
    assert d["deep"]["length_us"] == cp_results["event_sync"]["length_us"]
    assert cli.main([str(BASE), "--diff", str(OTHER), "--step", "1010"]) == 0
    out = capsys.readouterr().out
    assert "Primary bottleneck" in out and "Trace diff (HTA" in out and "added" in out
    assert cli.main([str(SYNC), "--deep", "critical-path", "--step", "5"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "ProfilerStep#5" in lines[0]


BLOCK_HTA = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "hta":
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
from stepdoctor_analysis.cli import analyze as cli
from stepdoctor_analysis.analyzers import deep
from stepdoctor_analysis.errors import TraceError
assert not deep.available() and "hta" not in sys.modules
try:
    deep.trace_diff(sys.argv[1], sys.argv[1])
except TraceError as exc:
    print("engine:", exc)
sys.exit(cli.main([sys.argv[1], "--deep", "critical-path"]))
"""


def test_missing_hta_is_a_clean_exit_2() -> None:
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_HTA, str(SYNC)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    assert out.stdout.strip().splitlines() == [
        "engine: deep analysis needs Holistic Trace Analysis: install 'stepdoctor[hta]'"
    ]
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "stepdoctor[hta]" in err[0] and "Traceback" not in out.stderr


def test_engine_imports_without_touching_hta() -> None:
    code = "import sys, stepdoctor_analysis.pipeline, stepdoctor_analysis.analyzers.deep; print('hta' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_staging_leaves_the_trace_directory_untouched(tmp_path: Path) -> None:
    """Staging never writes next to the user's trace (the shared fixtures are read-only)."""
    if not deep.available():
        pytest.skip("HTA extra not installed")
    p = tmp_path / "t.json.gz"
    shutil.copy(SYNC, p)
    deep.critical_path(p)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["t.json.gz"]
