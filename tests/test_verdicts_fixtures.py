"""The verdict and the first recommendation never contradict each other, on every real fixture,
wherever they are shown: the engine report, the CLI text, the run aggregate (what the API and the
run page serve) and the compare page's before/after; plus the labelled real cases of
docs/labelled-cases.md (the reasoning for each is written there)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_analysis.report.document import Report
from stepdoctor_server.runs.compare import compare_diagnoses
from stepdoctor_server.runs.diagnosis import StoredTrace
from support.fixtures import TRACES
from support.reports import as_verdict, server_run

ALL = sorted(p.relative_to(TRACES).as_posix() for p in TRACES.rglob("*.json.gz"))


@functools.cache
def _report(rel: str) -> Report:
    return analyze_path(TRACES / rel)


def _consistent(primary: dict[str, Any], recs: list[dict[str, Any]]) -> None:
    """The first card is about the primary kind, or the primary says in one sentence why not."""
    if recs and recs[0]["kind"] == primary["kind"]:
        return
    note = primary.get("note") or ""
    assert note and note.count(". ") <= 2, (primary, [r["id"] for r in recs])


@pytest.mark.parametrize("rel", ALL)
def test_verdict_and_first_recommendation_agree_everywhere(rel: str) -> None:
    report = _report(rel)
    d = report.to_dict()
    primary, recs = d["primary"], d["recommendations"]
    _consistent(primary, recs)
    for rec in recs:
        assert rec["expected_speedup"] > 1.02 and rec["change"]
        assert rec["basis"] in ("measured", "estimate")
        if rec["basis"] == "estimate":
            lo, hi = rec["expected_speedup_range"]
            assert 1.0 <= lo <= rec["expected_speedup"] <= hi
    # CLI text: the same verdict and the same first recommendation.
    text = report.render_text()
    assert f"Primary bottleneck: {primary['kind'].upper()}" in text
    if recs:
        assert f"Next optimization: {recs[0]['title']}" in text
    if primary["note"]:
        assert primary["note"] in text
    # Run aggregate (API /runs/{id}/diagnosis, run page): one trace -> the same verdict and card.
    run = server_run([StoredTrace(1, d["rank"], 0, None, d)])
    assert run["primary"]["kind"] == primary["kind"]
    assert [r["id"] for r in run["recommendations"]][:1] == [r["id"] for r in recs][:1]
    _consistent(run["primary"], run["recommendations"])
    # Compare page: a run against itself keeps its limiter.
    change = compare_diagnoses(as_verdict(run), as_verdict(run))["primary"]
    assert change["base"] == change["other"] == primary["kind"] and not change["changed"]
    # A GPU trace is never shown as CPU only; one figure per concept: the compute share (computation
    # kernels running) never exceeds GPU utilization (any kernel running) over the same steps.
    if d["metrics"].get("gpu"):
        assert d["device"] is not None and "CPU only" not in text
        assert d["metrics"]["shares"]["compute"] <= d["metrics"]["gpu"]["utilization"] + 0.005


# Labelled real traces: expected verdict, expected first recommendation (None: no card) and what
# must not be the first advice. Reasoning per case: docs/labelled-cases.md.
LABELLED = [
    (
        "hta/ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
        "compute",
        "compute.mixed_precision",
        None,
    ),
    ("hta/trace_diff/test/test.json.gz", "compute", "compute.mixed_precision", "transfer.pinned_memory"),
    (
        "hta/cpu_only/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz",
        "communication",
        None,
        "communication.overlap",
    ),
    (
        "hta/critical_path/simple_add/benchmark_result_493459_1694039959_trace.json.gz",
        "memory",
        "memory.allocator_steady_state",
        "sync.host_sync",
    ),
    (
        "tracelens/h100_google_owlv2-large-patch14-ensemble__1016001.json.gz",
        "input",
        "input.dataloader_workers",
        "compute.mixed_precision",
    ),
    (
        "tracelens/h100_facebook_timesformer-base-finetuned-k400__1016002.json.gz",
        "sync",
        None,
        "compute.mixed_precision",
    ),
    (
        "tracelens/h100_gaunernst_bert-small-uncased__1016001.json.gz",
        "launch",
        None,
        "compute.mixed_precision",
    ),
    (
        "tracelens/mi300_gaunernst_bert-small-uncased__1016001.json.gz",
        "launch",
        None,
        "compute.mixed_precision",
    ),
    (
        "tracelens/h100_Falconsai_nsfw_image_detection__1016002.json.gz",
        "launch",
        None,
        "compute.mixed_precision",
    ),
    (
        "tracelens/inference_sglang_decode_sglang_Qwen3-8B_decode.json.gz",
        "launch",
        None,
        "launch.cuda_graphs",
    ),
    ("tracelens/torch_compile_triton_trace.json.gz", "compute", None, "compute.mixed_precision"),
]


@pytest.mark.parametrize(("rel", "kind", "first", "never"), LABELLED)
def test_labelled_real_traces(rel: str, kind: str, first: str | None, never: str | None) -> None:
    d = _report(rel).to_dict()
    assert d["primary"]["kind"] == kind
    recs = d["recommendations"]
    if first is not None:
        assert recs and recs[0]["id"] == first
    else:
        assert not recs or recs[0]["kind"] == kind
    if never is not None:
        assert never not in [r["id"] for r in recs]


def test_bf16_inference_gets_no_precision_advice() -> None:
    """H100/MI300X HF models run bf16 GEMMs: never advise autocast to bf16 again."""
    for rel in ALL:
        if "tracelens" not in rel:
            continue
        ids = [f["id"] for f in _report(rel).to_dict()["findings"]]
        assert "compute.mixed_precision" not in ids, rel


def test_fixture_list_is_complete() -> None:
    assert len(ALL) >= 25 and all((TRACES / r).is_file() for r in ALL)
    assert Path(TRACES / "tracelens").is_dir()


def test_open_step_around_untraced_work_claims_nothing() -> None:
    """triton_example: one 1.8 µs kernel in a 13.3 s step left open around untraced work (compilation,
    export). The silence after the last kernel is unexplained time, not a 20× sync bubble."""
    d = _report("hta/triton_example/triton_example.json.gz").to_dict()
    assert d["metrics"]["shares"]["other"] > 0.99
    assert d["recommendations"] == []
    assert "Nothing in the step is removable" in d["primary"]["note"]


@pytest.mark.parametrize(
    "rel",
    ["hta/trace_diff/control/control.json.gz", "hta/negative_queue_length_values_check/rank0.json.gz"],
)
def test_fused_optimizer_gets_no_foreach_advice(rel: str) -> None:
    """These A100 ranks step with FusedAdam (multi-tensor kernels): never advise foreach for it."""
    ids = [f["id"] for f in _report(rel).to_dict()["findings"]]
    assert "launch.foreach_optimizer" not in ids


def test_foreach_advice_names_the_traced_sgd() -> None:
    d = _report("hta/df_index_resolver/df_index_resolver.json.gz").to_dict()
    rec = next(f for f in d["findings"] if f["id"] == "launch.foreach_optimizer")
    assert rec["change"].startswith("torch.optim.SGD(") and "AdamW" not in rec["change"]


def test_directory_verdict_and_first_card_agree() -> None:
    """``stepdoctor analyze DIR``: the job's limiter heads the report and the first card fits it."""
    d = analyze_path(TRACES / "hta" / "trace_filter").to_dict()
    assert d["ranks"]["limiter"] == d["primary"]["kind"]
    _consistent(d["primary"], d["recommendations"])
