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
    }


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
    b = (base.get("primary") or {}).get("kind")
    o = (other.get("primary") or {}).get("kind")
    return {"base": b, "other": o, "changed": b != o}
