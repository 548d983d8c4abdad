"""Rules as data: each one names a bottleneck kind, a trigger threshold, the code change to make,
why (from evidence), caveats, and a query that measures the trigger metric and the step time the
change could remove. Every number a query applies sits in its rule (``threshold`` and the named
``thresholds`` the query receives), and so does its scope, so a rule is one self-describing record.

- ``record``: the ``Rule`` record, the ``Context`` a query reads and the ``Hit`` it returns;
- ``bottlenecks``, ``beyond_ddp``, ``memory_advice``: the queries;
- ``catalog``: every record, ``RULES`` per trace and ``JOB_RULES`` per job;
- here: looking rules up (``rule``, ``documented_rules``, ``declared``, ``pattern_minimums``) and
  firing them (``fired``).
"""

from __future__ import annotations

from .. import BOTTLENECK_KINDS
from ..report.consistency import Declared
from .catalog import JOB_RULES, RULES
from .record import Context, Hit, Rule, fire

KINDS = BOTTLENECK_KINDS


def rule(rule_id: str) -> Rule:
    """The rule with this id, per trace or per job (``KeyError`` if none)."""
    found = next((r for r in documented_rules() if r.id == rule_id), None)
    if found is None:
        raise KeyError(rule_id)
    return found


def documented_rules() -> list[Rule]:
    """Every card the engine can give: the per-trace rules, then the job-level ones."""
    return [*RULES, *JOB_RULES]


def fired(ctx: Context) -> list[tuple[Rule, Hit]]:
    """Every rule of ``RULES`` that fires on ``ctx``, with its hit (``record.fire``)."""
    return fire(RULES, ctx)


def declared(rule_id: str) -> Declared:
    """What rule ``rule_id`` declares about its finding's text, for ``consistency`` (findings no
    rule renders, e.g. the straggler card, declare nothing and claim a speedup)."""
    found = next((r for r in documented_rules() if r.id == rule_id), None)
    return Declared(found.asserts, found.claims_speedup) if found is not None else Declared()


def pattern_minimums() -> dict[str, float]:
    """Anti-pattern id (``ops``) -> the threshold of the rule that reads it, for ``ops.analyze_ops``."""
    return {
        "single_tensor_optimizer": rule("launch.foreach_optimizer").threshold,
        "zero_grad_fill": rule("memory.zero_grad_set_to_none").threshold,
        "fp32_matmul": rule("compute.tf32").threshold,
        "select_loop": rule("launch.select_loop").threshold,
        "small_htod_copies": rule("transfer.small_copies").threshold,
    }


# The verdict text (``diagnose``) says "almost no compute to hide communication behind" with the
# same limit the overlap rule applies.
NO_COMPUTE_RATIO = rule("communication.overlap").thresholds["no_compute_ratio"]
