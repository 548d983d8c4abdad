"""The documented rule table, docs/rules.md: every card the engine can give (``rules.documented_rules``:
the per-trace rules, then the job-level straggler card), so the docs table, docs/verdicts.md's
coverage test and anything else that lists "every rule" read one list.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import documented_rules
from .record import Rule


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _number(value: float) -> str:
    return f"{value:g}"


def rules_markdown(rules: Sequence[Rule] | None = None) -> str:
    """docs/rules.md: the table of every documented rule (``make docs`` writes it)."""
    lines = [
        "# Rules",
        "",
        "Generated from `stepdoctor_analysis.rules.RULES` and the job-level straggler card",
        "(`stepdoctor_analysis.rules.doc`) by `make docs`; do not edit by hand. What each kind means and",
        "what to try first: [verdicts.md](verdicts.md).",
        "A rule fires when its query's metric reaches **threshold**; its other limits are listed by name.",
        "**still runs after**: the floors (host work, device, kernels, copies) its change leaves in place; its",
        "gain is cut to the step time above the highest of them.",
        "",
        "| id | kind | title | fires when | threshold | other limits | still runs after | workloads | basis |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in documented_rules() if rules is None else rules:
        limits = ", ".join(f"`{k}`={_number(v)}" for k, v in r.thresholds.items())
        row = (
            r.id,
            r.kind,
            r.title,
            r.trigger,
            _number(r.threshold),
            limits,
            ", ".join(r.keeps),
            ", ".join(r.workloads),
            r.basis,
        )
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines) + "\n"
