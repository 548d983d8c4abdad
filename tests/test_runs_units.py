"""Pure parts of the analysis service: run aggregation, run comparison, TensorBoard names and zip."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stepdoctor_analysis.run.verdict import merge_recommendations
from stepdoctor_server.runs.compare import compare_diagnoses
from stepdoctor_server.runs.diagnosis import StoredTrace, aggregate_run
from stepdoctor_server.runs.export import ExportItem, archive_names, stream_zip, worker_name
from support.reports import recommendation, report, verdict
from support.reports import steps as step_rows


def _report(
    kernel: float, loader: float, *, steps: int, shares: dict[str, float], recs: list[str]
) -> dict[str, Any]:
    kinds = {k: v for k, v in shares.items() if k != "other"}  # "other" is never a verdict
    primary = max(kinds, key=lambda k: kinds[k])
    return report(
        breakdown={"kernel": kernel, "dataloader": loader, "other": 0.0},
        step_time_us=kernel + loader,
        steps=step_rows(steps),
        metrics={"shares": shares},
        primary={"kind": primary, "share": kinds[primary]},
        recommendations=[recommendation(r, expected_speedup=1.0 + i) for i, r in enumerate(recs)],
        findings=[recommendation(f"f.{r}") for r in recs],
    )


def _aggregate(traces: list[StoredTrace], **counts: int) -> dict[str, Any]:
    """The server's run diagnosis as the API returns it."""
    out: dict[str, Any] = msgspec.to_builtins(aggregate_run(traces, **counts))
    return out


def _merge(traces: list[StoredTrace]) -> list[dict[str, Any]]:
    """The run's merged cards over readable reports (100 µs steps in these tests)."""
    from stepdoctor_analysis.run.ranks import TraceEntry
    from stepdoctor_server.traces.reports import read_report

    entries = [TraceEntry(doc, rank=t.rank) for t in traces if (doc := read_report(t.report)) is not None]
    out: list[dict[str, Any]] = msgspec.to_builtins(merge_recommendations(entries, 100.0, None))
    return out


def test_aggregate_weights_by_steps_and_picks_the_limiter() -> None:
    # rank 0: 1 step of 100 µs, 90% input; rank 1: 3 steps of 300 µs, 60% compute / 40% input.
    a = _report(10.0, 90.0, steps=1, shares={"input": 0.9, "compute": 0.1, "other": 0.0}, recs=["in.workers"])
    b = _report(180.0, 120.0, steps=3, shares={"input": 0.4, "compute": 0.6}, recs=["amp", "in.workers"])
    diag = _aggregate([StoredTrace(1, 0, 0, None, a), StoredTrace(2, 1, 0, None, b)])

    assert diag["traces"] == 2 and diag["steps"] == 4
    assert diag["breakdown"]["kernel"] == pytest.approx((10.0 * 1 + 180.0 * 3) / 4)
    assert diag["breakdown"]["dataloader"] == pytest.approx((90.0 * 1 + 120.0 * 3) / 4)
    assert diag["step_time_us"] == pytest.approx((100.0 + 300.0 * 3) / 4)
    # Time owned: input 0.9*100 + 0.4*900 = 450; compute 0.1*100 + 0.6*900 = 550 of 1000 µs.
    # Compute owns more time, but the measured input wait (45%, 1.8x if removed) is the limiter:
    # these reports carry no compute estimate, and the device is not busy enough to call it compute-bound.
    assert diag["primary"]["kind"] == "input"
    assert diag["primary"]["share"] == pytest.approx(0.45)
    assert diag["shares"]["compute"] == pytest.approx(0.55)
    assert diag["shares"]["input"] == pytest.approx(0.45)
    # Rank 1 is 1.5x the median (200 µs) of the two ranks -> straggler; rank 0 is not.
    assert [s["rank"] for s in diag["stragglers"]] == [1]
    assert diag["rank_spread"]["max_over_min"] == pytest.approx(3.0)
    # Per-rank verdicts follow the same limiter rule: rank 1's 40% input wait (1.67x) outranks its
    # compute, for which these reports give no estimate.
    assert {r["rank"]: r["primary_kind"] for r in diag["ranks"]} == {0: "input", 1: "input"}


def test_other_time_never_becomes_the_primary_kind() -> None:
    rep = _report(10.0, 0.0, steps=1, shares={"other": 0.8, "launch": 0.2}, recs=[])
    assert _aggregate([StoredTrace(1, 0, 0, None, rep)])["primary"]["kind"] == "launch"


def test_recommendations_merge_by_id_with_run_level_gain() -> None:
    def rec(rid: str, removable_us: float) -> dict[str, Any]:
        return recommendation(rid, kind="launch", change="x", removable_us_per_step=removable_us)

    reports = [
        StoredTrace(
            1, 0, 0, None, report(step_time_us=100.0, recommendations=[rec("a", 10.0), rec("b", 5.0)])
        ),
        StoredTrace(2, 1, 0, None, report(step_time_us=100.0, recommendations=[rec("b", 50.0)])),
        StoredTrace(
            3, 2, 0, None, report(step_time_us=100.0, recommendations=[rec("b", 20.0), rec("a", 1.0)])
        ),
    ]
    merged = _merge(reports)
    assert [m["id"] for m in merged] == ["b", "a"]
    assert merged[0]["traces"] == 3 and merged[0]["first_in"] == 2 and merged[0]["ranks"] == [0, 1, 2]
    # b removes (5 + 50 + 20) / 300 of the run's time: 25% -> 1.33x, not the best window's 2x.
    assert merged[0]["expected_speedup"] == pytest.approx(1 / 0.75, abs=1e-3)
    # a removes 11/300 = 3.7% -> 1.04x: still a card (above 1.02x).
    assert merged[1]["expected_speedup"] == pytest.approx(1 / (1 - 11 / 300), abs=1e-3)


def test_tiny_gains_are_not_cards() -> None:
    reports = [
        StoredTrace(
            1,
            0,
            0,
            None,
            report(
                step_time_us=100.0,
                recommendations=[recommendation("a", kind="launch", change="x", removable_us_per_step=1.0)],
            ),
        )
    ]
    assert _merge(reports) == []


def test_outdated_reports_are_left_out_of_the_run_and_counted() -> None:
    """A stored report that does not decode as the contract (an older engine's shape) is outdated:
    the run is aggregated from the others, as if it were still pending, and never crashes."""
    current = _report(10.0, 90.0, steps=2, shares={"input": 0.9, "compute": 0.1}, recs=["in.workers"])
    old_engine = {  # a pre-contract report: no steps rows, metrics, device ...
        "breakdown": {"kernel": 1000.0},
        "step_time_us": 1000.0,
        "primary": {"kind": "compute", "share": 1.0},
        "recommendations": [{"id": "old.rule", "change": "x", "expected_speedup": "fast"}],
    }
    typo = {**current, "step_time_us": "100"}  # a mistyped field is not read as 0 either
    diag = _aggregate(
        [
            StoredTrace(1, 0, 0, None, current),
            StoredTrace(2, 1, 0, None, old_engine),
            StoredTrace(3, 2, 0, None, typo),
        ]
    )
    alone = _aggregate([StoredTrace(1, 0, 0, None, current)])
    assert diag["outdated"] == 2 and alone["outdated"] == 0
    assert {k: v for k, v in diag.items() if k != "outdated"} == {
        k: v for k, v in alone.items() if k != "outdated"
    }
    assert [r["id"] for r in _merge([StoredTrace(2, 1, 0, None, old_engine)])] == []

    only_old = _aggregate([StoredTrace(2, 1, 0, None, old_engine)], pending=1)
    assert only_old["primary"] is None and only_old["traces"] == 0 and only_old["outdated"] == 1


def test_empty_run_has_no_primary() -> None:
    diag = _aggregate([], failed=2)
    assert diag["primary"] is None and diag["failed"] == 2


def test_compare_deltas_speedup_and_findings() -> None:
    base = {
        "step_time_us": 200.0,
        "breakdown": {"kernel": 100.0, "dataloader": 100.0},
        "primary": {"kind": "input"},
        "findings": [{"id": "input.workers", "kind": "input"}, {"id": "launch.graphs", "kind": "launch"}],
    }
    other = {
        "step_time_us": 125.0,
        "breakdown": {"kernel": 100.0, "dataloader": 25.0},
        "primary": {"kind": "compute"},
        "findings": [{"id": "launch.graphs", "kind": "launch"}, {"id": "compute.amp", "kind": "compute"}],
    }
    cmp = compare_diagnoses(verdict(**base), verdict(**other))
    assert cmp["speedup"] == pytest.approx(1.6)
    assert cmp["categories"]["dataloader"]["delta_us"] == pytest.approx(-75.0)
    assert cmp["categories"]["dataloader"]["delta_pct"] == pytest.approx(-75.0)
    assert cmp["categories"]["kernel"]["delta_us"] == 0.0
    assert cmp["findings"] == {
        "resolved": ["input.workers"],
        "appeared": ["compute.amp"],
        "persisting": ["launch.graphs"],
    }
    primary = cmp["primary"]
    assert (primary["base"], primary["other"], primary["changed"]) == ("input", "compute", True)
    assert primary["sentence"] == "The limiter moved from input to compute."


def test_a_diagnosis_compare_cannot_read_is_a_409_not_a_crash() -> None:
    from stepdoctor_server.core.errors import ApiError
    from stepdoctor_server.core.models import Run
    from stepdoctor_server.runs.service import run_diagnosis

    good = msgspec.to_builtins(
        verdict(traces=1, step_time_us=5.0, findings=[{"id": "a", "title": "A", "traces": 1}])
    )
    assert run_diagnosis(Run(id=7, diagnosis=good)).findings[0].title == "A"  # read typed
    with pytest.raises(ApiError) as err:
        run_diagnosis(Run(id=7, diagnosis={"traces": 1, "step_time_us": "fast"}))
    assert (err.value.status, err.value.code) == (409, "outdated")


def test_compare_handles_zero_base() -> None:
    cmp = compare_diagnoses(verdict(step_time_us=0.0, breakdown={"memset": 0.0}), verdict(step_time_us=5.0))
    assert cmp["speedup"] is None and cmp["categories"]["memset"]["delta_pct"] is None


def test_tensorboard_names_match_the_plugin_patterns(tmp_path: Path) -> None:
    consts = pytest.importorskip("torch_tb_profiler.consts")
    gz = tmp_path / "a.json.gz"
    gz.write_bytes(b"\x1f\x8b rest")
    plain = tmp_path / "b.json"
    plain.write_bytes(b"{}")
    items = [
        ExportItem(gz, rank=1, window_index=0, host="node.a", trace_id=3),
        ExportItem(gz, rank=0, window_index=1, host="node.a", trace_id=2),
        ExportItem(gz, rank=0, window_index=1, host="node.a", trace_id=4),  # same window uploaded twice
        ExportItem(plain, rank=None, window_index=None, host=None, trace_id=9),
    ]
    names = [name for name, _ in archive_names("run-1", items)]
    assert len(set(names)) == len(names) == 4
    parsed = []
    for name in names:
        run_dir, file_name = name.split("/")
        assert run_dir == "run-1"
        m = consts.WORKER_PATTERN.match(file_name)
        assert m is not None, file_name
        node = consts.NODE_PROCESS_PATTERN.match(m.group(1))
        assert node is not None
        parsed.append((m.group(1), m.group(2), node.group(2), file_name.endswith(".gz")))
    assert parsed[0][:3] == ("node-a_0", ".000001", "0")
    assert parsed[1][:3] == ("node-a_0", ".000002", "0")
    assert parsed[2][:3] == ("node-a_1", ".000000", "1")
    assert parsed[3][3] is False and all(p[3] for p in parsed[:3])
    assert worker_name("h", 7, 1) == "h_7"
    assert (
        worker_name(None, None, 1) == worker_name(None, None, 2) == "node_0"
    )  # one process: spans of one worker


def test_stream_zip_round_trips_large_members(tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    payload = bytes(range(256)) * 20_000  # 5 MB: several chunks
    big.write_bytes(payload)
    small = tmp_path / "small.bin"
    small.write_bytes(b"x")
    chunks = list(stream_zip([("r/a.pt.trace.json.gz", big), ("r/b.pt.trace.json", small)]))
    assert len(chunks) > 2
    with zipfile.ZipFile(io.BytesIO(b"".join(chunks))) as zf:
        assert zf.testzip() is None
        assert zf.read("r/a.pt.trace.json.gz") == payload
        assert zf.read("r/b.pt.trace.json") == b"x"


def test_demo_diagnosis_line() -> None:
    from stepdoctor_server.demo import diagnosis_line

    run = {
        "diagnosis": {
            "primary": {"kind": "input", "share": 0.6},
            "step_time_us": 12_500.0,
            "recommendations": [{"title": "Use DataLoader workers"}],
        }
    }
    assert (
        diagnosis_line("w0", run)
        == "w0: input-bound (60% of step time), mean step 12.5 ms -> next: Use DataLoader workers"
    )
    assert "2 trace(s) failed" in diagnosis_line(
        "w1", {"diagnosis": {"primary": None}, "trace_status": {"failed": 2}}
    )
