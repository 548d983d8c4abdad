"""torch's memory timeline in the trace (``stepdoctor.profile(..., memory_timeline=True)``) and the engine's
use of it for ``memory.by_category`` (``parsing.memory_timeline``, ``memory_use.torch_breakdown``): a real CPU
training loop under the agent, with and without the option."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from stepdoctor.memory_timeline import KEY, append_key, compact
from stepdoctor.spool import TRACE_SUFFIX
from stepdoctor_analysis.analyzers.memory_use import CATEGORIES, TORCH_BASIS
from stepdoctor_analysis.parsing import load_trace
from stepdoctor_analysis.pipeline import analyze_path
from support import cpu_loops


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int]]:
    """``cpu_loops.adam_agent_loop`` with and without the option, each in a fresh process
    (``cpu_loops.run_fresh``: tensors freed after recording would inflate later CPU traces here)."""
    out = {}
    for name, on in (("timeline", True), ("inferred", False)):
        spool = tmp_path_factory.mktemp(name)
        cpu_loops.run_fresh(
            f"torch.set_num_threads(1); adam_agent_loop(Path({str(spool)!r}), memory_timeline={on})"
        )
        (trace,) = (spool / "local" / "timeline").glob(f"*{TRACE_SUFFIX}")
        out[name] = (trace, cpu_loops.ADAM_MLP_PARAM_BYTES)
    return out


def _top_level(trace: Path) -> dict[str, Any]:
    with gzip.open(trace, "rb") as fh:
        data: dict[str, Any] = json.load(fh)
    return data


def test_the_agent_embeds_torchs_timeline_and_the_engine_uses_its_categories(
    recorded: dict[str, tuple[Path, int]],
) -> None:
    trace, param_bytes = recorded["timeline"]
    embedded = _top_level(trace)[KEY]
    assert embedded["device"] == "cpu" and {"PARAMETER", "OPTIMIZER_STATE", "ACTIVATION"} <= set(
        embedded["columns"]
    )
    assert load_trace(trace).memory_timeline is not None  # the streaming splitter still finds traceEvents
    memory = analyze_path(trace).to_dict()["metrics"]["memory"]
    (peak,) = memory["by_category"]
    assert peak["basis"] == TORCH_BASIS
    assert set(peak["bytes"]) == set(CATEGORIES)
    assert sum(peak["bytes"].values()) == peak["allocated"]  # the categories add up
    assert sum(peak["shares"].values()) == pytest.approx(1.0, abs=1e-3)
    # torch labels the weights and Adam's moments itself: no inference needed. Its labelling of a
    # tensor at the peak varies between runs (one CI run read 1.5x the weights as parameters), so
    # the weights are at least counted, and the moments are there
    assert param_bytes <= peak["bytes"]["parameters"] <= 2 * param_bytes
    assert peak["bytes"]["optimizer_state"] > 0
    assert (
        peak["bytes"]["gradients"] > 0 and peak["bytes"]["activations"] > 0
    )  # the peak falls in a backward and peak["bytes"]["inputs"] == 2 * 256 * 256 * 4
    (series,) = memory["series"]["categories"]
    assert series["basis"] == "torch" and "optimizer_state" in series["categories"]


def test_without_the_option_the_categories_are_inferred(recorded: dict[str, tuple[Path, int]]) -> None:
    trace, _ = recorded["inferred"]
    assert KEY not in _top_level(trace)
    assert load_trace(trace).memory_timeline is None
    (peak,) = analyze_path(trace).to_dict()["metrics"]["memory"]["by_category"]
    assert peak["basis"] != TORCH_BASIS and peak["basis"].startswith("phases from the host ops")
    assert sum(peak["bytes"].values()) == peak["allocated"]


def test_a_malformed_timeline_is_ignored_and_the_categories_inferred(
    recorded: dict[str, tuple[Path, int]], tmp_path: Path
) -> None:
    trace, _ = recorded["inferred"]
    plain = tmp_path / "bad.pt.trace.json"
    plain.write_bytes(gzip.decompress(trace.read_bytes()))
    bad = compact([1, 2], [[0, 5, 5], [0, 6, 6]], ("PARAMETER", "GRADIENT"), "cpu")
    bad["columns"]["GRADIENT"] = [6]  # one value short
    append_key(plain, KEY, bad)
    assert json.loads(plain.read_text())[KEY] == bad  # still one valid JSON object
    assert load_trace(plain).memory_timeline is None
    (peak,) = analyze_path(plain).to_dict()["metrics"]["memory"]["by_category"]
    assert peak["basis"].startswith("phases from the host ops")


def test_compact_keeps_the_peak_and_at_most_max_points() -> None:
    times = list(range(0, 10_000, 2))
    sizes = [[0, t % 97, 3] for t in times]
    sizes[1234][1] = 10_000  # the one peak
    doc = compact(times, sizes, ("PARAMETER", "ACTIVATION"), "cpu", max_points=100)
    assert len(doc["t_us"]) <= 100 and doc["t_us"] == sorted(doc["t_us"])
    assert max(doc["columns"]["PARAMETER"]) == 10_000
    assert times[1234] in doc["t_us"]
