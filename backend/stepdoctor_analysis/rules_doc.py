"""The documented rule table: every card the engine can give, for docs/rules.md and the verdict guide.

``rules.RULES`` holds the per-trace rules; the straggler card is decided per job
(``ranks.straggler_advice``), so it is not in that table, yet users see it like any other card. Here
it is described as a rule record too (its threshold is ``ranks.STRAGGLER``), so the docs table,
docs/verdicts.md's coverage test and anything else that lists "every rule" read one list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from . import ranks
from .rules import RULES, Context, Hit, Rule


def _per_job(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    """Never fires on one trace: ``ranks.straggler_advice`` gives the card for a job's ranks."""
    return None


STRAGGLER_RULE = Rule(
    id=ranks.STRAGGLER_ID,
    kind="communication",
    title="Even out the ranks: one rank holds the others back",
    trigger=f"a rank's busy time before its collectives exceeds the other ranks' median by "
    f"> {100 * ranks.STRAGGLER:g}% of it (per job)",
    threshold=ranks.STRAGGLER,
    query=_per_job,
    change="by the straggler's cause: balance its work, feed it faster, free its host CPU, or drop its own syncs",
    why="{rank} works longer before its collectives than the others; every other rank waits for it.",
    caveats=("DDP bucket sizes or compression do not help while the others are waiting, not sending.",),
)


def documented_rules() -> list[Rule]:
    """Every card the engine can give: the per-trace rules, then the job-level straggler card."""
    return [*RULES, STRAGGLER_RULE]


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
        "(`stepdoctor_analysis.rules_doc`) by `make docs`; do not edit by hand. What each kind means and",
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
