"""Numbers as people read them: durations in the unit that fits, sizes in binary units, factors > 1.

Registered as Jinja filters (``register``) so every page formats the same value the same way, and
writes data into ``<script>`` elements the same way: ``script_json`` (the server's one escaper for
that context). Templates never mark data ``| safe``; ``tests/test_dashboard_escaping.py`` checks.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from jinja2 import Environment

from stepdoctor_analysis.cli.analyze import byte_text
from stepdoctor_dashboard.escaping import script_json


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def duration(us: Any) -> str:
    """µs → ``850 µs``, ``12.3 ms``, ``41.6 s``, ``3.5 min`` (three significant digits)."""
    x = _number(us)
    if x is None:
        return "–"
    sign, x = ("−" if x < 0 else ""), abs(x)
    if x < 1e3:
        return f"{sign}{x:.3g} µs" if x >= 1 or x == 0 else f"{sign}{x:.2f} µs"
    if x < 1e6:
        return f"{sign}{_sig(x / 1e3)} ms"
    if x < 600e6:
        return f"{sign}{_sig(x / 1e6)} s"
    return f"{sign}{_sig(x / 60e6)} min"


def _sig(x: float) -> str:
    return f"{x:.3g}" if x < 1000 else f"{x:,.0f}"


def size(n: Any) -> str:
    """Bytes → ``812 B``, ``23.6 KiB``, ``4.6 MiB``, ``1.21 GiB``."""
    x = _number(n)
    return "–" if x is None else byte_text(x)


def percent(fraction: Any, digits: int = 0) -> str:
    x = _number(fraction)
    return "–" if x is None else f"{x * 100:.{digits}f}%"


def factor(speedup: Any) -> str:
    """A speedup (base / other step time) as ``1.60× faster`` or ``1.60× slower``: never below 1×."""
    x = _number(speedup)
    if x is None or x <= 0:
        return "–"
    if abs(x - 1.0) < 0.005:
        return "about the same speed"
    return f"{x:.2f}× faster" if x > 1 else f"{1 / x:.2f}× slower"


def _utc(value: Any) -> datetime | None:
    """A stored time in UTC: the database keeps UTC, and SQLite hands it back without a zone."""
    if not isinstance(value, datetime):
        return None
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def when(value: Any) -> str:
    """A time as people read it, with its zone: ``2026-11-26 08:33 UTC`` (``–`` when unknown)."""
    t = _utc(value)
    return "–" if t is None else t.strftime("%Y-%m-%d %H:%M UTC")


def iso_time(value: Any) -> str:
    """The same time for a ``<time datetime=...>`` attribute: ISO 8601 with its offset."""
    t = _utc(value)
    return "" if t is None else t.isoformat(timespec="seconds")


def register(env: Environment) -> None:
    env.filters.update(
        duration=duration,
        size=size,
        percent=percent,
        factor=factor,
        script_json=script_json,
        when=when,
        iso_time=iso_time,
    )
