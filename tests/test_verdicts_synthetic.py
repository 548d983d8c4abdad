"""Issue #9 verdict classes on synthetic traces: the verdict is the limiter, iterations are found
without step markers, compute advice fits the kernels' precision and the device, advice names
what the trace shows, and a GPU trace without device properties is still a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_server.runs.compare import compare_diagnoses
from stepdoctor_server.runs.diagnosis import StoredTrace
from support import verdict_traces as vt
from support.reports import as_verdict, server_run


def _analyze(path: Path) -> dict[str, Any]:
    return analyze_path(path).to_dict()


def _ids(recs: list[dict[str, Any]]) -> list[str]:
    return [r["id"] for r in recs]


@pytest.fixture(scope="module")
def resnet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    d = tmp_path_factory.mktemp("resnet")
    return {
        "workers0": _analyze(vt.resnet_input_bound(d / "w0.json")),
        "workers4": _analyze(vt.resnet_input_bound(d / "w4.json", workers=4)),
    }


# 1. The verdict is the limiter ---------------------------------------------------------------


def test_input_stall_is_the_limiter_though_compute_owns_more_time(resnet: dict[str, dict[str, Any]]) -> None:
    r = resnet["workers0"]
    shares = r["metrics"]["shares"]
    assert shares["compute"] > shares["input"] > 0.3  # compute owns more time...
    assert r["primary"]["kind"] == "input"  # ...but the measured input wait limits the step
    assert r["primary"]["basis"] == "measured" and r["primary"]["note"] == ""
    first = r["recommendations"][0]
    assert first["id"] == "input.dataloader_workers" and "num_workers=" in first["change"]
    assert first["basis"] == "measured" and first["expected_speedup_range"] is None
    # An estimated compute speedup ranks after the measured wait, with a range.
    amp = next(x for x in r["recommendations"] if x["id"] == "compute.mixed_precision")
    assert amp["basis"] == "estimate" and amp["expected_speedup_range"][0] < amp["expected_speedup_range"][1]
    # One percentage per concept: the compute share is the GPU's busy fraction, not a second figure.
    assert shares["compute"] == pytest.approx(r["metrics"]["gpu"]["utilization"], abs=0.01)


def test_fixed_loader_turns_the_run_compute_bound_and_compare_says_so(
    resnet: dict[str, dict[str, Any]],
) -> None:
    fixed = resnet["workers4"]
    assert fixed["primary"]["kind"] == "compute"
    assert fixed["recommendations"][0]["id"] == "compute.mixed_precision"
    base = server_run([StoredTrace(1, None, 0, None, resnet["workers0"])])
    other = server_run([StoredTrace(2, None, 0, None, fixed)])
    assert base["primary"]["kind"] == "input" and base["recommendations"][0]["kind"] == "input"
    change = compare_diagnoses(as_verdict(base), as_verdict(other))["primary"]
    assert (change["base"], change["other"], change["changed"]) == ("input", "compute", True)
    assert change["base_kind_us"]["delta_pct"] < -90  # the input stall all but vanished
    assert "input to compute" in change["sentence"]


def test_run_verdict_comes_from_all_windows_not_the_first(resnet: dict[str, dict[str, Any]]) -> None:
    # Three fixed windows and one slow one: the run is compute-bound, whichever trace came first.
    reports = [StoredTrace(1, None, 0, None, resnet["workers0"])] + [
        StoredTrace(i, None, i, None, resnet["workers4"]) for i in range(2, 5)
    ]
    run = server_run(reports)
    assert run["primary"]["kind"] == "compute"
    assert run["recommendations"][0]["kind"] == "compute"
    # The input card's gain is the run's (one window in four), below what that window alone claims.
    inp = next(x for x in run["recommendations"] if x["id"] == "input.dataloader_workers")
    assert inp["expected_speedup"] < resnet["workers0"]["recommendations"][0]["expected_speedup"]
    # One figure per concept at run level too: utilization weighted like the shares, never below compute.
    assert run["gpu_utilization"] >= run["shares"]["compute"] - 0.005


# 2. Iterations without step markers --------------------------------------------------------


@pytest.mark.parametrize(
    ("anchor", "source"), [("dataloader", "dataloader"), ("optimizer", "optimizer"), ("module", "module")]
)
def test_iterations_found_and_warmup_set_apart(tmp_path: Path, anchor: str, source: str) -> None:
    r = _analyze(vt.no_markers_warmup(tmp_path / f"{anchor}.json", anchor=anchor))
    it = r["iterations"]
    assert it["source"] == source and it["count"] == 5
    assert it["warmup"]["count"] == 1 and it["warmup"]["ratio_to_median"] > 5
    assert len(r["steps"]) == 5 and max(s["duration_us"] for s in r["steps"]) < 3_000  # steady state only
    # The warm-up's blocking sync and autotuning kernels do not become the verdict.
    assert r["primary"]["kind"] == "compute"
    assert "sync.host_sync" not in _ids(r["findings"])
    assert any("warm-up" in w for w in r["warnings"])


def test_nothing_repeats_no_per_step_gain_is_claimed(tmp_path: Path) -> None:
    r = _analyze(vt.single_call(tmp_path / "single.json"))
    assert r["iterations"]["source"] == "none"
    assert any("no repeating iteration" in w for w in r["warnings"])
    assert r["recommendations"] == []  # no "CUDA graphs: up to 14x" from one call
    assert all(f["expected_speedup"] == 1.0 and f["basis"] == "single-pass" for f in r["findings"])
    assert "one-time" in r["primary"]["note"]
    assert r["primary"]["confidence"] < 0.7


# 3. Precision-aware compute advice ---------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "arch", "dtype"),
    [("fp32", "sm70", "float16"), ("fp32", "sm80", "bfloat16"), ("fp32", "sm90", "bfloat16")],
)
def test_fp32_matmuls_get_the_dtype_the_device_supports(
    tmp_path: Path, precision: str, arch: str, dtype: str
) -> None:
    r = _analyze(vt.compute_bound(tmp_path / "c.json", precision=precision, arch=arch))
    assert r["primary"]["kind"] == "compute"
    first = r["recommendations"][0]
    assert first["id"] == "compute.mixed_precision"
    assert f"dtype=torch.{dtype}" in first["change"]
    if dtype == "float16":
        assert "GradScaler" in first["change"] and "bfloat16" not in first["change"]
        assert "compute.tf32" not in _ids(r["findings"])  # Volta has no TF32
    else:
        assert "compute.tf32" in _ids(r["recommendations"])


@pytest.mark.parametrize(
    ("precision", "arch"),
    [("fp16", "sm70"), ("bf16", "sm80"), ("bf16", "sm90"), ("fp8", "sm90"), ("fp16", "sm80")],
)
def test_reduced_precision_matmuls_get_no_precision_advice(tmp_path: Path, precision: str, arch: str) -> None:
    r = _analyze(vt.compute_bound(tmp_path / "c.json", precision=precision, arch=arch))
    assert r["primary"]["kind"] == "compute"
    ids = _ids(r["findings"])
    assert "compute.mixed_precision" not in ids and "compute.tf32" not in ids
    assert "compute.no_cheap_win" in ids
    assert "No cheap compute win" in r["primary"]["note"]


def test_no_tensor_cores_no_precision_advice(tmp_path: Path) -> None:
    r = _analyze(vt.compute_bound(tmp_path / "p100.json", precision="fp32", arch="sm60"))
    assert r["primary"]["kind"] == "compute" and r["recommendations"] == []
    assert "no compute change" in r["primary"]["note"]


# 4. Advice fits the evidence ---------------------------------------------------------------


@pytest.mark.parametrize(("optimizer", "other"), [("SGD", "AdamW"), ("AdamW", "SGD")])
def test_foreach_names_the_optimizer_in_the_trace(tmp_path: Path, optimizer: str, other: str) -> None:
    r = _analyze(vt.optimizer_step(tmp_path / "opt.json", optimizer=optimizer))
    rec = next(x for x in r["recommendations"] if x["id"] == "launch.foreach_optimizer")
    assert f"torch.optim.{optimizer}(" in rec["change"] and other not in rec["change"]
    assert "foreach=True" in rec["change"] and rec["basis"] == "estimate"


def test_no_card_at_or_below_two_percent(tmp_path: Path, resnet: dict[str, dict[str, Any]]) -> None:
    for r in resnet.values():
        assert all(x["expected_speedup"] > 1.02 for x in r["recommendations"])


# 5. GPU without deviceProperties -----------------------------------------------------------


def test_gpu_trace_without_device_properties_is_a_gpu(tmp_path: Path) -> None:
    report = analyze_path(vt.without_device_properties(tmp_path / "kineto2021.json"))
    d = report.to_dict()
    assert d["device"]["type"] == "gpu" and d["device"]["name"] is None
    text = report.render_text()
    assert "GPU (name unknown)" in text and "CPU only" not in text
    # No properties: the volta_* kernels bound the architecture from below (sm_70+), so the advice is
    # the one every such device supports: fp16 with a GradScaler, never bf16.
    assert d["device"]["arch"] == "sm_70+" and d["device"]["precisions"] == ["fp16"]
    amp = next(r for r in d["recommendations"] if r["id"] == "compute.mixed_precision")
    assert (
        "torch.float16" in amp["change"] and "GradScaler" in amp["change"] and "bfloat16" not in amp["change"]
    )


def test_no_overlap_advice_without_compute(tmp_path: Path) -> None:
    r = _analyze(vt.communication_only(tmp_path / "comm.json"))
    assert r["primary"]["kind"] == "communication"
    # Nothing to hide it behind: overlap would gain nothing, so it is neither a card nor a finding
    # ("Hide gradient communication behind compute … up to 1.00×" promised nothing).
    assert "communication.overlap" not in _ids(r["recommendations"]) + _ids(r["findings"])
    assert (
        not r["recommendations"] or r["recommendations"][0]["kind"] == "communication" or r["primary"]["note"]
    )
