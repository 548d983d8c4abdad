"""The typed report contract: every fixture's report is a ``ReportDoc``, the published JSON Schema
is current, the CLI prints it and OpenAPI documents the report's fields."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient

from stepdoctor_analysis import BOTTLENECK_KINDS, SCHEMA_VERSION
from stepdoctor_analysis.analyzers.comm import CommStats
from stepdoctor_analysis.analyzers.ops import OpStats
from stepdoctor_analysis.cli.analyze import main as analyze_main
from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_analysis.report import contract

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "traces"
TRACES = sorted(p for p in FIXTURES.rglob("*.json.gz") if p.is_file())  # every fixture trace is gzipped


@functools.cache
def _published_validator() -> Any:
    """A JSON Schema validator for docs/report.schema.json: checks the published file itself, not msgspec."""
    jsonschema = pytest.importorskip(
        "jsonschema", reason="jsonschema comes with the dev extra's schemathesis"
    )
    schema = json.loads((ROOT / "docs" / "report.schema.json").read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_every_fixture_report_is_the_contract_and_round_trips(trace: Path) -> None:
    report = analyze_path(trace)
    d = report.to_dict()
    doc = report.typed()
    assert isinstance(doc.primary, contract.Bottleneck) and doc.schema_version == SCHEMA_VERSION
    # Nothing dropped or changed: the typed form carries every key and value of the JSON form.
    assert contract.to_dict(doc) == d
    _published_validator().validate(d)  # any JSON Schema client accepts the report as it is
    assert json.dumps(contract.to_dict(doc), sort_keys=True) == json.dumps(d, sort_keys=True)
    assert contract.decode(json.dumps(d).encode()) == doc
    # Sections typed by their analyzers' own dataclasses read as attributes, no guards.
    assert isinstance(doc.metrics.communication, CommStats) and isinstance(doc.metrics.ops, OpStats)
    assert (doc.metrics.gpu is not None) == ("gpu" in d["metrics"])
    for rec in doc.recommendations:
        assert rec.expected_speedup >= 1.0 and rec.kind in BOTTLENECK_KINDS


def test_a_job_directory_report_is_the_contract_too() -> None:
    """``analyze DIR``: the job's verdict, per-rank section and a straggler card when there is one."""
    directory = FIXTURES / "hta" / "trace_filter"
    d = analyze_path(directory).to_dict()
    doc = contract.decode(d)
    assert doc.ranks is not None and doc.ranks["count"] >= 2
    _published_validator().validate(d)
    assert json.dumps(contract.to_dict(doc), sort_keys=True) == json.dumps(d, sort_keys=True)


def test_the_engine_builds_the_contract_types() -> None:
    """diagnose and pipeline construct the contract's own types: one definition, not a mirror."""
    from stepdoctor_analysis.report import document as report
    from stepdoctor_analysis.rules import diagnose

    assert diagnose.Recommendation is contract.Recommendation and diagnose.Bottleneck is contract.Bottleneck
    assert report.StepRow is contract.StepRow
    r = analyze_path(TRACES[0])
    assert isinstance(r.primary, contract.Bottleneck) and all(
        isinstance(s, contract.StepRow) for s in r.steps
    )
    with pytest.raises(ValueError, match="kind must be one of"):
        contract.Bottleneck(kind="vibes", share=0.1, us_per_step=1.0, confidence=0.5)


def test_contract_refuses_what_it_does_not_declare() -> None:
    d = analyze_path(TRACES[0]).to_dict()
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        contract.decode(d | {"surprise": 1})
    broken: dict[str, Any] = json.loads(json.dumps(d))
    broken["primary"]["kind"] = "vibes"
    with pytest.raises(msgspec.ValidationError, match=r"kind must be one of.*primary"):
        contract.decode(broken)
    errors = list(_published_validator().iter_errors(broken))
    assert [list(e.absolute_path) for e in errors] == [["primary", "kind"]]


def test_published_schema_is_current_and_printed_by_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    committed = (ROOT / "docs" / "report.schema.json").read_text(encoding="utf-8")
    assert committed == contract.schema_text(), "docs/report.schema.json is stale: run `make docs`"
    assert analyze_main(["--schema"]) == 0
    assert capsys.readouterr().out == committed
    schema = json.loads(committed)
    doc = schema["$defs"]["ReportDoc"]
    assert doc["properties"]["schema_version"]["const"] == SCHEMA_VERSION
    assert {"primary", "recommendations", "breakdown", "steps", "metrics", "limiter"} <= set(
        doc["properties"]
    )
    assert "expected_speedup" in schema["$defs"]["Recommendation"]["properties"]


def test_cli_without_a_path_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        analyze_main([])
    assert exc.value.code == 2 and "path" in capsys.readouterr().err


def test_openapi_shows_the_report_fields(tmp_path: Path) -> None:
    from stepdoctor_server.core.settings import Settings
    from stepdoctor_server.web.app import create_app

    spec = TestClient(create_app(Settings(data_dir=tmp_path, workers=0))).get("/openapi.json").json()
    schemas = spec["components"]["schemas"]

    def report_schema(model: str) -> dict[str, Any]:
        prop = schemas[model]["properties"]["report"]
        return next((s for s in prop.get("anyOf", [prop]) if s.get("type") == "object"), prop)

    for model in ("AnalysisOut", "ReportOut"):
        report = report_schema(model)
        props = report["properties"]
        assert {"primary", "recommendations", "breakdown", "steps", "metrics"} <= set(props), model
        rec = props["recommendations"]["items"]["properties"]
        assert rec["expected_speedup"]["type"] == "number"
        assert "kind" in props["primary"]["properties"]
        metrics = props["metrics"]["properties"]
        assert "exposed_ns_per_step" in metrics["communication"]["properties"]
        assert "utilization" in metrics["gpu"]["anyOf"][0]["properties"]
    assert "#/$defs/" not in json.dumps(spec)  # every reference resolves inside the OpenAPI document
