"""Before/after comparison of two run diagnoses (as built by ``aggregate.aggregate_run``).

Pure. Speedup follows the usual convention: base step time / other step time, so > 1 means the
other run is faster. Deltas are other - base (negative = time saved).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stepdoctor_server.aggregate import CATEGORIES


def compare_diagnoses(base: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """Per-category deltas (µs and %), speedup, finding changes and primary-kind change."""
    base_time = float(base.get("step_time_us") or 0.0)
    other_time = float(other.get("step_time_us") or 0.0)
    return {
        "step_time_us": {"base": base_time, "other": other_time, **_delta(base_time, other_time)},
        "speedup": base_time / other_time if base_time > 0 and other_time > 0 else None,
        "categories": category_deltas(base.get("breakdown") or {}, other.get("breakdown") or {}),
        "primary": _primary_change(base, other),
        "findings": finding_changes(base.get("findings") or [], other.get("findings") or []),
        "kinds": kind_deltas(base, other),
        "finding_titles": finding_titles(base.get("findings") or [], other.get("findings") or []),
        "followed": followed_recommendation(base, other),
    }


def kind_deltas(base: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """µs per step of each bottleneck kind (share × mean step time), before and after, largest change first."""
    b_time, o_time = float(base.get("step_time_us") or 0.0), float(other.get("step_time_us") or 0.0)
    b_shares, o_shares = base.get("shares") or {}, other.get("shares") or {}
    out = {}
    for kind in {*b_shares, *o_shares}:
        b = float(b_shares.get(kind) or 0.0) * b_time
        o = float(o_shares.get(kind) or 0.0) * o_time
        out[str(kind)] = {"base_us": b, "other_us": o, "delta_us": o - b}
    return dict(sorted(out.items(), key=lambda kv: -abs(kv[1]["delta_us"])))


def finding_titles(base: list[Any], other: list[Any]) -> dict[str, str]:
    """Finding id -> its title, so pages name findings as people read them, never by internal id."""
    titles: dict[str, str] = {}
    for f in [*base, *other]:
        if isinstance(f, Mapping) and f.get("id"):
            titles.setdefault(str(f["id"]), str(f.get("title") or f["id"]))
    return titles


def followed_recommendation(base: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, Any] | None:
    """The base run's next optimization, its predicted speedup, and what the other run measured.

    "Followed" means the recommendation no longer fires on the other run; either way the measured
    speedup is shown next to the prediction, which closes the loop on the advice.
    """
    recs = [r for r in base.get("recommendations") or [] if isinstance(r, Mapping) and r.get("id")]
    if not recs:
        return None
    rec = recs[0]
    still = {str(r.get("id")) for r in other.get("recommendations") or [] if isinstance(r, Mapping)}
    still |= {str(f.get("id")) for f in other.get("findings") or [] if isinstance(f, Mapping)}
    b_time, o_time = float(base.get("step_time_us") or 0.0), float(other.get("step_time_us") or 0.0)
    predicted = rec.get("expected_speedup")
    return {
        "id": str(rec["id"]),
        "title": str(rec.get("title") or rec["id"]),
        "kind": rec.get("kind"),
        "basis": rec.get("basis"),
        "predicted_speedup": predicted if isinstance(predicted, int | float) else None,
        "measured_speedup": b_time / o_time if b_time > 0 and o_time > 0 else None,
        "followed": str(rec["id"]) not in still,
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


def category_deltas(base: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    keys = [k for k in CATEGORIES if k in base or k in other]
    keys += sorted(k for k in {*base, *other} if k not in CATEGORIES)
    out = {}
    for key in keys:
        b, o = float(base.get(key) or 0.0), float(other.get(key) or 0.0)
        out[key] = {"base_us": b, "other_us": o, **_delta(b, o)}
    return out


def finding_changes(base: list[Any], other: list[Any]) -> dict[str, list[str]]:
    """Finding ids resolved (only in base), appeared (only in other) and persisting (in both)."""
    b = {str(f["id"]) for f in base if isinstance(f, Mapping) and f.get("id")}
    o = {str(f["id"]) for f in other if isinstance(f, Mapping) and f.get("id")}
    return {"resolved": sorted(b - o), "appeared": sorted(o - b), "persisting": sorted(b & o)}


def _delta(base: float, other: float) -> dict[str, float | None]:
    """Absolute and relative change; the relative one is undefined when the base is zero."""
    return {"delta_us": other - base, "delta_pct": (other - base) / base * 100.0 if base else None}


def _primary_change(base: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """The limiter before and after, with how much of the base limiter's time is left.

    Both kinds come from each run's aggregate (``aggregate.aggregate_run``), the same verdict the
    run pages show, so "input → compute" here is what the two run pages say.
    """
    b = (base.get("primary") or {}).get("kind")
    o = (other.get("primary") or {}).get("kind")
    out: dict[str, Any] = {"base": b, "other": o, "changed": b != o}
    if b:
        b_us = float((base.get("shares") or {}).get(b) or 0.0) * float(base.get("step_time_us") or 0.0)
        o_us = float((other.get("shares") or {}).get(b) or 0.0) * float(other.get("step_time_us") or 0.0)
        out |= {"base_kind_us": {"base": b_us, "other": o_us, **_delta(b_us, o_us)}}
        if b != o and o:
            pct = out["base_kind_us"]["delta_pct"]
            fell = f" ({b} time {pct:+.0f}%)" if isinstance(pct, float) else ""
            out["sentence"] = f"The limiter moved from {b} to {o}{fell}."
        elif o:
            out["sentence"] = f"Still {o}-bound."
    return out
