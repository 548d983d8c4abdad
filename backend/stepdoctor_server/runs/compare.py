"""Before/after comparison of two runs' verdicts (``run_verdict.RunVerdict``, typed).

Pure. Speedup follows the usual convention: base step time / other step time, so > 1 means the
other run is faster. Deltas are other - base (negative = time saved).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stepdoctor_analysis import BREAKDOWN_CATEGORIES as CATEGORIES
from stepdoctor_analysis.run.timeline import Comparison
from stepdoctor_analysis.run.verdict import RunCard, RunFinding, RunVerdict

Card = RunCard | RunFinding


def compare_diagnoses(b: RunVerdict, o: RunVerdict, step: Comparison | None = None) -> dict[str, Any]:
    """Per-category deltas (µs and %), speedup, finding changes and primary-kind change.

    ``step``: the engine's comparison of the two runs' step times (``run_timeline.compare``, other
    against base; what ``stepdoctor check`` says): the unprofiled steady state when both runs have
    a step series. The speedup and the measured side of "predicted vs measured" use its basis;
    without it, the profiled step times of the diagnoses (basis "profiled").
    """
    basis = step_basis(b, o, step)
    return {
        "step_time_us": {
            "base": b.step_time_us,
            "other": o.step_time_us,
            **_delta(b.step_time_us, o.step_time_us),
        },
        "step": basis,
        "speedup": basis["speedup"],
        "categories": category_deltas(b.breakdown, o.breakdown),
        "primary": _primary_change(b, o),
        "findings": finding_changes(b.findings, o.findings),
        "kinds": kind_deltas(b, o),
        "finding_titles": finding_titles(b.findings, o.findings),
        "followed": followed_recommendation(b, o, basis),
    }


def step_basis(base: RunVerdict, other: RunVerdict, step: Comparison | None) -> dict[str, Any]:
    """The step times compared (ms), their basis, change (other / base - 1) and speedup (base / other)."""
    if step is not None and step.basis == "unprofiled":
        b_ms, o_ms, basis = step.baseline_ms, step.candidate_ms, step.basis
    else:  # the diagnoses' own (unrounded) profiled step times: the engine's basis, same numbers
        b_ms, o_ms, basis = base.step_time_us / 1e3, other.step_time_us / 1e3, "profiled"
    ok = b_ms > 0 and o_ms > 0
    return {
        "basis": basis,
        "base_ms": b_ms,
        "other_ms": o_ms,
        "change": o_ms / b_ms - 1.0 if ok else None,
        "speedup": b_ms / o_ms if ok else None,
    }


def kind_deltas(base: RunVerdict, other: RunVerdict) -> dict[str, dict[str, float]]:
    """µs per step of each bottleneck kind (share × mean step time), before and after, largest change first."""
    out = {}
    for kind in {*base.shares, *other.shares}:
        b = base.shares.get(kind, 0.0) * base.step_time_us
        o = other.shares.get(kind, 0.0) * other.step_time_us
        out[kind] = {"base_us": b, "other_us": o, "delta_us": o - b}
    return dict(sorted(out.items(), key=lambda kv: -abs(kv[1]["delta_us"])))


def finding_titles(base: Sequence[Card], other: Sequence[Card]) -> dict[str, str]:
    """Finding id -> its title, so pages name findings as people read them, never by internal id."""
    titles: dict[str, str] = {}
    for f in [*base, *other]:
        if f.id:
            titles.setdefault(f.id, f.title or f.id)
    return titles


def followed_recommendation(
    base: RunVerdict, other: RunVerdict, basis: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The base run's next optimization, its predicted speedup, and what the other run measured.

    "Followed" means the recommendation no longer fires on the other run; either way the measured
    speedup is shown next to the prediction, which closes the loop on the advice. Measured on
    ``basis`` (``step_basis``: the unprofiled steady state when both runs have a series).
    """
    basis = basis if basis is not None else step_basis(base, other, None)
    recs = [r for r in base.recommendations if r.id]
    if not recs:
        return None
    rec = recs[0]
    still = {r.id for r in other.recommendations} | {f.id for f in other.findings}
    return {
        "id": rec.id,
        "title": rec.title or rec.id,
        "kind": rec.kind,
        "basis": rec.basis,
        "predicted_speedup": rec.expected_speedup,
        "measured_speedup": basis["speedup"],
        "measured_basis": basis["basis"],
        "followed": rec.id not in still,
    }


def context_differences(base: Mapping[str, Any], other: Mapping[str, Any]) -> list[str]:
    """Sentences for what differs between two runs' setups (devices, batch size, world size):
    a speedup across different setups is not the effect of a code change alone."""
    labels = {"devices": "devices", "batch_size": "batch size", "world_size": "world size"}
    out = []
    for key, label in labels.items():
        b, o = base.get(key), other.get(key)
        if b is not None and o is not None and b != o:
            out.append(f"The runs differ in {label}: {b} vs {o}.")
    return out


def category_deltas(base: Mapping[str, float], other: Mapping[str, float]) -> dict[str, dict[str, Any]]:
    keys = [k for k in CATEGORIES if k in base or k in other]
    keys += sorted(k for k in {*base, *other} if k not in CATEGORIES)
    out = {}
    for key in keys:
        b, o = base.get(key, 0.0), other.get(key, 0.0)
        out[key] = {"base_us": b, "other_us": o, **_delta(b, o)}
    return out


def finding_changes(base: Sequence[Card], other: Sequence[Card]) -> dict[str, list[str]]:
    """Finding ids resolved (only in base), appeared (only in other) and persisting (in both)."""
    b = {f.id for f in base if f.id}
    o = {f.id for f in other if f.id}
    return {"resolved": sorted(b - o), "appeared": sorted(o - b), "persisting": sorted(b & o)}


def _delta(base: float, other: float) -> dict[str, float | None]:
    """Absolute and relative change; the relative one is undefined when the base is zero."""
    return {"delta_us": other - base, "delta_pct": (other - base) / base * 100.0 if base else None}


def _primary_change(base: RunVerdict, other: RunVerdict) -> dict[str, Any]:
    """The limiter before and after, with how much of the base limiter's time is left.

    Both kinds come from each run's aggregate (``run_verdict.run_verdict``), the same verdict the
    run pages show, so "input → compute" here is what the two run pages say.
    """
    b = base.primary.kind if base.primary else None
    o = other.primary.kind if other.primary else None
    out: dict[str, Any] = {"base": b, "other": o, "changed": b != o}
    if b:
        b_us = base.shares.get(b, 0.0) * base.step_time_us
        o_us = other.shares.get(b, 0.0) * other.step_time_us
        out |= {"base_kind_us": {"base": b_us, "other": o_us, **_delta(b_us, o_us)}}
        if b != o and o:
            pct = out["base_kind_us"]["delta_pct"]
            fell = f" ({b} time {pct:+.0f}%)" if isinstance(pct, float) else ""
            out["sentence"] = f"The limiter moved from {b} to {o}{fell}."
        elif o:
            out["sentence"] = f"Still {o}-bound."
    return out
