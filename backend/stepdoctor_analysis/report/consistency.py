"""The last stage of a diagnosis: what a report shows never contradicts itself or promises nothing.

Rules fire independently, each from its own evidence, so two of them can state opposite facts
("FP32 GEMMs run on CUDA cores" next to "GEMM kernels already run in bf16") and a rule can fire
with a gain too small to act on ("Hide gradient communication … up to 1.00×"). This stage runs over
the rendered findings, whichever rules fired, so it holds for rules added later too:

- **Advice that promises nothing is not shown.** A finding with a code change whose shown gain (the
  high end of an estimate's range, else its point) is at most ``MIN_ADVICE_SPEEDUP`` is dropped,
  unless its rule claims no speedup at all (``Rule.claims_speedup``: memory pressure's change averts
  an out-of-memory failure). A finding without a change is a measured fact and stays, without a
  range (it promises no speedup).
- **No finding denies another.** Each rule declares the facts its text asserts (``Rule.asserts``);
  a fact ``"no X"`` denies ``"X"``. Findings are visited in rank order and one that asserts a fact
  an earlier, kept finding denies is dropped: the finding that removes more of the step stands.

Pure functions over ``Recommendation`` lists; ``diagnose.classify`` calls ``consistent`` before it
picks the cards and words the verdict's note, so the note reads the same findings the report shows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgspec

from .contract import Recommendation

MIN_ADVICE_SPEEDUP = 1.01  # advice whose shown gain is at most this promises nothing
NEGATION = "no "


@dataclass(frozen=True)
class Declared:
    """What a rule declares about its finding's text (``rules.declared``)."""

    asserts: tuple[str, ...] = ()  # the facts it states; "no X" denies "X"
    claims_speedup: bool = True  # False: its change averts a failure, it promises no faster step


def shown_gain(rec: Recommendation) -> float:
    """The speedup a reader sees for ``rec``: an estimate's high end, else its point."""
    return rec.expected_speedup_range[1] if rec.expected_speedup_range else rec.expected_speedup


def is_advice(rec: Recommendation) -> bool:
    """A finding that asks for a code change (a fact has no change)."""
    return bool(rec.change)


def promises_nothing(rec: Recommendation, declared: Declared) -> bool:
    """Advice whose shown gain is no gain (a change that claims no speedup never promised one)."""
    return is_advice(rec) and declared.claims_speedup and shown_gain(rec) <= MIN_ADVICE_SPEEDUP


def negation(fact: str) -> str:
    """``"X"`` <-> ``"no X"``."""
    return fact[len(NEGATION) :] if fact.startswith(NEGATION) else NEGATION + fact


def contradictions(facts: Iterable[tuple[str, Iterable[str]]]) -> list[tuple[str, str, str]]:
    """(finding a, finding b, the fact a asserts and b denies) for every contradicting pair."""
    seen: list[tuple[str, frozenset[str]]] = [(name, frozenset(fs)) for name, fs in facts]
    out = []
    for i, (a, fa) in enumerate(seen):
        for b, fb in seen[i + 1 :]:
            out += [(a, b, f) for f in sorted(fa) if negation(f) in fb]
    return out


def consistent(recs: Sequence[Recommendation], declared: Callable[[str], Declared]) -> list[Recommendation]:
    """``recs`` (in rank order) without advice that promises nothing and without a finding that
    asserts a fact a higher-ranked kept finding denies; facts lose their meaningless range.

    ``declared``: rule id -> what that rule declares about its finding (``rules.declared``).
    """
    kept: list[Recommendation] = []
    denied: set[str] = set()
    for rec in recs:
        said = declared(rec.id)
        if promises_nothing(rec, said):
            continue
        facts = set(said.asserts)
        if facts & denied:
            continue
        denied |= {negation(f) for f in facts}
        if not is_advice(rec) and rec.expected_speedup_range is not None:
            rec = msgspec.structs.replace(rec, expected_speedup_range=None)
        kept.append(rec)
    return kept
