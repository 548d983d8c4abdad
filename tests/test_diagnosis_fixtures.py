"""Every real Kineto fixture trace analyzes end to end; the JSON report keeps its documented schema."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from stepdoctor_analysis import SCHEMA_VERSION
from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_analysis.report.document import BREAKDOWN_KEYS
from stepdoctor_analysis.rules import KINDS
from support.fixtures import HTA_TRACES as HTA
from support.fixtures import all_fixture_files

FILES = all_fixture_files()
REC_KEYS = {
    "id": str,
    "title": str,
    "kind": str,
    "change": str,
    "why": str,
    "expected_speedup": float,
    "caveats": list,
}


@functools.cache
def _report(path: Path) -> dict[str, Any]:
    return analyze_path(path).to_dict()


def _check_schema(d: dict[str, Any]) -> None:
    assert d["schema_version"] == SCHEMA_VERSION and isinstance(d["engine_version"], str)
    p = d["primary"]
    assert p["kind"] in KINDS
    assert isinstance(p["share"], float) and 0.0 <= p["share"] <= 1.0
    assert isinstance(p["confidence"], float) and 0.0 < p["confidence"] <= 1.0
    assert isinstance(p["evidence"], dict)
    # The primary is the limiter (most removable time), not necessarily the largest share.
    assert all(s["kind"] in KINDS and s["kind"] != p["kind"] for s in d["secondary"])
    assert [s["share"] for s in d["secondary"]] == sorted((s["share"] for s in d["secondary"]), reverse=True)
    assert set(d["breakdown"]) == set(BREAKDOWN_KEYS)
    assert all(isinstance(v, float) and v >= 0 for v in d["breakdown"].values())
    for rec in d["recommendations"] + d["findings"]:
        for key, typ in REC_KEYS.items():
            assert isinstance(rec[key], typ), (key, rec)
        assert rec["kind"] in KINDS and rec["expected_speedup"] >= 1.0
    assert all(r["change"] for r in d["recommendations"])
    assert isinstance(d["steps"], list) and d["steps"]
    for s in d["steps"]:
        assert isinstance(s["number"], int) and s["duration_us"] >= 0 and set(s["kinds"]) >= set(KINDS)
    assert isinstance(d["metrics"], dict) and isinstance(d["warnings"], list)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(HTA)))
def test_fixture_analyzes_and_round_trips(path: Path) -> None:
    d = _report(path)
    _check_schema(d)
    text = json.dumps(d, allow_nan=False)
    assert json.loads(text) == d
    # Shares of the seven kinds plus unexplained time cover each step once.
    assert sum(d["metrics"]["shares"].values()) == pytest.approx(1.0, abs=0.01)


def test_directory_of_ranks_has_rank_section() -> None:
    d = analyze_path(HTA / "trace_filter").to_dict()
    _check_schema(d)
    ranks = d["ranks"]
    assert ranks["count"] == 2
    assert isinstance(ranks["spread"], float) and isinstance(ranks["stragglers"], list)
    assert {r["rank"] for r in ranks["per_rank"]} == {0, 1}
    assert all(r["primary_kind"] in KINDS for r in ranks["per_rank"])


def test_memory_events_give_device_peaks() -> None:
    """df_index_resolver is the one fixture with [memory] events (V100-32GB)."""
    d = _report(HTA / "df_index_resolver" / "df_index_resolver.json.gz")
    cuda = [m for m in d["metrics"]["memory"]["devices"] if m["device"].startswith("cuda")]
    assert cuda, d["metrics"]["memory"]
    top = max(cuda, key=lambda m: m["peak_allocated"])
    assert 0 < top["peak_allocated"] <= top["capacity"]
    assert top["capacity"] > 30 * 2**30
    assert top["allocs_per_step"] > 0
