"""What a wait is and whether it recurs: one-pass traces get per-pass advice for waits that recur
(many and alike) and none for those that may be one-time (few and long); a blocking host-to-device
copy is the transfer's, not a user sync; a loop of tiny device-to-host reads is the sync's, with
its own change; phase words only where the trace shows the phase."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from stepdoctor_analysis.pipeline import analyze_path
from support import synthetic_dist as sd
from support import verdict_traces as vt

PHASE_WORDS = re.compile(r"\b(decode|decoding|prefill|serving|server|tokens?)\b", re.IGNORECASE)


def _analyze(path: Path) -> dict[str, Any]:
    return analyze_path(path).to_dict()


def _ids(recs: list[dict[str, Any]]) -> list[str]:
    return [r["id"] for r in recs]


def _texts(r: dict[str, Any]) -> str:
    parts = [r["primary"]["note"]]
    for f in r["findings"]:
        parts += [f["title"], f["change"], f["why"], *f["caveats"]]
    return "\n".join(parts)


# One pass: recurring vs one-time waits ------------------------------------------------------------


def test_one_pass_with_recurring_launch_gaps_gets_a_per_pass_launch_card(tmp_path: Path) -> None:
    r = _analyze(vt.one_pass_forward(tmp_path / "fwd.json"))
    assert r["iterations"]["source"] == "none"  # one pass: nothing repeats as an iteration
    assert r["primary"]["kind"] == "launch"
    first = r["recommendations"][0]
    assert first["kind"] == "launch" and first["basis"] == "measured"
    assert first["expected_speedup"] > 1.5 and r["primary"]["gain"] == first["expected_speedup"]
    assert first["evidence"]["one_pass"]["recurring_waits"] >= 500
    assert "of the pass" in first["why"] and "of the step" not in first["why"]
    assert "one-time" not in r["primary"]["note"]


def test_one_pass_gain_leaves_out_a_first_call_wait(tmp_path: Path) -> None:
    """The same forward after a 2 ms first call: the card still stands, and its per-pass gain counts
    the recurring gaps, not the one-time wait."""
    plain = _analyze(vt.one_pass_forward(tmp_path / "fwd.json"))
    first = _analyze(vt.one_pass_forward(tmp_path / "first.json", first_call_us=2_000))
    card = first["recommendations"][0]
    assert card["kind"] == "launch"
    assert first["primary"]["us_per_step"] > plain["primary"]["us_per_step"] + 1_900  # the wait is seen
    assert abs(card["removable_us_per_step"] - plain["recommendations"][0]["removable_us_per_step"]) < 100
    assert card["evidence"]["one_pass"]["one_time_candidates_us"] >= 1_900
    assert any("one-time" in c for c in card["caveats"])


def test_one_pass_whose_cost_is_one_first_call_gets_no_gain(tmp_path: Path) -> None:
    r = _analyze(vt.first_call(tmp_path / "first_call.json"))
    assert r["iterations"]["source"] == "none"
    assert r["primary"]["kind"] == "launch"
    assert r["recommendations"] == []
    assert r["primary"]["gain"] == 1.0
    assert all(f["basis"] == "single-pass" and f["expected_speedup"] == 1.0 for f in r["findings"])
    assert "one-time" in r["primary"]["note"] and "1 stretch " in r["primary"]["note"]


# Blocking copies: transfer, not sync ------------------------------------------------------------


def test_blocking_pageable_htod_copies_are_transfer_with_the_pinned_card(tmp_path: Path) -> None:
    r = _analyze(vt.pageable_htod_loop(tmp_path / "htod.json"))
    assert r["primary"]["kind"] == "transfer"
    first = r["recommendations"][0]
    assert first["id"] == "transfer.pinned_memory"
    assert "pin_memory=True" in first["change"] and "non_blocking=True" in first["change"]
    # Which op blocked, and in which direction.
    assert "aten::to blocks the host copying host→device" in first["why"]
    assert first["evidence"]["blocking_htod"]["ops"][0]["op"] == "aten::to"
    # Never a user sync: no sync card, no ".item()" advice, and the idle around the copies is transfer.
    texts = _texts(r)
    assert not any(f["kind"] == "sync" for f in r["findings"])
    assert "Remove per-step" not in texts and ".item()" not in texts
    assert r["metrics"]["shares"]["sync"] < 0.01
    assert r["metrics"]["sync"]["calls_per_step"] == 0


def test_element_by_element_cpu_reads_are_sync_with_reduce_on_the_device(tmp_path: Path) -> None:
    r = _analyze(vt.cpu_per_element(tmp_path / "cpu.json"))
    assert r["iterations"]["source"] == "none"
    assert r["primary"]["kind"] == "sync"
    first = r["recommendations"][0]
    assert first["id"] == "sync.element_reads"
    assert "vectorized op on the device" in first["change"] and ".item()" in first["change"]
    assert "per pass" in first["why"] and first["expected_speedup"] > 2
    assert first["evidence"]["dtoh_reads_per_step"] == 2_000 and first["evidence"]["median_read_bytes"] == 4
    ids = _ids(r["findings"])
    assert "transfer.pinned_memory" not in ids
    assert "sync.host_sync" not in ids and "inference.host_sync" not in ids  # one sync card, this one


def test_item_reads_in_a_training_step_keep_the_sync_card(tmp_path: Path) -> None:
    """20 `.item()` reads per step are not an element loop: the general sync card stays."""
    from support.synthetic import sync_bound_trace

    r = _analyze(sync_bound_trace(tmp_path / "sync.json"))
    assert r["primary"]["kind"] == "sync"
    assert r["recommendations"][0]["id"] == "sync.host_sync"
    assert "sync.element_reads" not in _ids(r["findings"])


# Phase words only where the phase is shown --------------------------------------------------------


def test_no_phase_words_for_a_forward_or_an_element_loop(tmp_path: Path) -> None:
    for r in (
        _analyze(vt.one_pass_forward(tmp_path / "fwd.json")),
        _analyze(vt.cpu_per_element(tmp_path / "cpu.json")),
    ):
        assert r["workload"]["phase"] is None
        assert r["findings"]
        assert not PHASE_WORDS.search(_texts(r)), PHASE_WORDS.search(_texts(r))


@pytest.mark.parametrize("kernels", [300])
def test_a_decode_loop_keeps_its_phase_words(tmp_path: Path, kernels: int) -> None:
    r = _analyze(sd.decode_loop_trace(tmp_path / "decode.json", kernels=kernels))
    assert r["workload"]["phase"] == "decode"
    assert "decode" in r["recommendations"][0]["change"]
