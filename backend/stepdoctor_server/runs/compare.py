"""Before/after comparison of two runs' verdicts (``run_verdict.RunVerdict``, typed).

Pure. Speedup follows the usual convention: base step time / other step time, so > 1 means the
other run is faster. Deltas are other - base (negative = time saved).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stepdoctor_analysis import BREAKDOWN_CATEGORIES as CATEGORIES
from stepdoctor_analysis.run_verdict import RunCard, RunFinding, RunVerdict

Card = RunCard | RunFinding


def compare_diagnoses(b: RunVerdict, o: RunVerdict) -> dict[str, Any]:
    """Per-category deltas (µs and %), speedup, finding changes and primary-kind change."""
    return {
        "step_time_us": {
            "base": b.step_time_us,
            "other": o.step_time_us,
            **_delta(b.step_time_us, o.step_time_us),
        },
        "speedup": _speedup(b, o),
        "categories": category_deltas(b.breakdown, o.breakdown),
        "primary": _primary_change(b, o),
        "findings": finding_changes(b.findings, o.findings),
        "kinds": kind_deltas(b, o),
        "finding_titles": finding_titles(b.findings, o.findings),
        "followed": followed_recommendation(b, o),
    }


def _speedup(base: RunVerdict, other: RunVerdict) -> float | None:
    b, o = base.step_time_us, other.step_time_us
    return b / o if b > 0 and o > 0 else None


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


def followed_recommendation(base: RunVerdict, other: RunVerdict) -> dict[str, Any] | None:
    """The base run's next optimization, its predicted speedup, and what the other run measured.

    "Followed" means the recommendation no longer fires on the other run; either way the measured
    speedup is shown next to the prediction, which closes the loop on the advice.
    """
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
        "measured_speedup": _speedup(base, other),
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
