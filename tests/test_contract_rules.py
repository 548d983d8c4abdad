"""Rules as data: keyword records holding every threshold their query applies; docs generated from them."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest

from stepdoctor_analysis import rules
from stepdoctor_analysis.analyzers import ops
from stepdoctor_analysis.rules import catalog, documented_rules, rule
from stepdoctor_analysis.rules.doc import rules_markdown
from stepdoctor_analysis.rules.record import Rule

ROOT = Path(__file__).resolve().parent.parent


def _gen_docs():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_rules_doc_is_the_generated_table() -> None:
    committed = (ROOT / "docs" / "rules.md").read_text(encoding="utf-8")
    assert committed == rules_markdown(), "docs/rules.md is stale: run `make docs`"
    assert _gen_docs().generated()[ROOT / "docs" / "rules.md"] == committed


def test_table_has_one_row_per_rule_with_its_limits() -> None:
    rows = [line for line in rules_markdown().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == [r.id for r in documented_rules()]
    overlap = next(row for row in rows if row.startswith("| communication.overlap |"))
    assert "`no_compute_ratio`=0.1" in overlap
    assert "| 20 |" in next(row for row in rows if row.startswith("| launch.foreach_optimizer |"))


def test_rules_are_keyword_only_records() -> None:
    with pytest.raises(TypeError):
        Rule("x", "sync", "t", "w", 0.1, lambda c, t: None, "c", "w")  # type: ignore[misc]


def test_the_catalog_record_is_the_rule_that_runs() -> None:
    """Every rule is one keyword ``Rule(...)`` in ``catalog.RULES`` or ``catalog.JOB_RULES``, in
    order, and the record that runs is that one: its query is the function the record names (no
    wrapper added at import), its scope the fields the record states."""
    tree = ast.parse(inspect.getsource(catalog))
    lists = {
        n.target.id: n.value
        for n in tree.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and isinstance(n.value, ast.List)
    }
    assert set(lists) == {"RULES", "JOB_RULES"}
    records = [
        n
        for name in ("RULES", "JOB_RULES")
        for n in lists[name].elts
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Rule"
    ]
    running_rules = documented_rules()
    assert running_rules == [*rules.RULES, *catalog.JOB_RULES]
    assert len(records) == sum(len(v.elts) for v in lists.values()) == len(running_rules)
    for node, running in zip(records, running_rules, strict=True):
        assert not node.args, f"positional Rule(...) at line {node.lineno}"
        fields = {k.arg: k.value for k in node.keywords}
        rid = fields["id"]
        assert (
            getattr(catalog, rid.id) if isinstance(rid, ast.Name) else ast.literal_eval(rid)
        ) == running.id
        query = fields["query"]
        if isinstance(query, ast.Name):  # a query function, named: it is the one that runs
            assert running.query is getattr(catalog, query.id), running.id
        for scope in ("collectives", "allocator", "yields_to"):
            if scope in fields:
                assert getattr(running, scope) == ast.literal_eval(fields[scope]), (running.id, scope)
    overlap = rule("communication.overlap")
    assert overlap.workloads == ("training",) and None in (overlap.collectives or ())


def test_queries_read_limits_from_their_rule_not_module_constants() -> None:
    """Changing a rule's limit changes what it decides: the number lives in the rule."""
    compute = rule("compute.mixed_precision")
    assert {"min_fp32_share", "fp32_gain", "tf32_gain_high"} <= set(compute.thresholds)
    # The two compute rules are complements: they must share the FP32 share that separates them.
    assert rule("compute.no_cheap_win").thresholds["min_fp32_share"] == compute.thresholds["min_fp32_share"]
    assert rule("communication.overlap").thresholds["no_compute_ratio"] == rules.NO_COMPUTE_RATIO
    assert not hasattr(rules, "MIN_FP32_WORK") and not hasattr(rules, "_PRECISION_GAIN")


def test_pattern_thresholds_come_from_the_rules() -> None:
    """ops lists an anti-pattern exactly when the rule reading it reaches its threshold."""
    minimums = rules.pattern_minimums()
    assert minimums["select_loop"] == rule("launch.select_loop").threshold == 1000
    assert minimums["small_htod_copies"] == rule("transfer.small_copies").threshold == 50
    assert minimums["single_tensor_optimizer"] == rule("launch.foreach_optimizer").threshold == 20
    many = ops.AntiPattern("select_loop", 10.0, {"select_calls_per_step": 1200.0})
    assert many.metric == 1200.0 and ops.AntiPattern("zero_grad_fill", 1.0, {}).metric == 1.0


def test_a_rule_with_a_changed_limit_decides_differently() -> None:
    import dataclasses

    from stepdoctor_analysis.rules.record import Hit

    seen: list[float] = []

    def query(_ctx, lim):  # type: ignore[no-untyped-def]
        seen.append(lim["cut"])
        return Hit(1.0, 0.0, {}, confidence=0.9) if lim["cut"] < 1 else None

    base = Rule(
        id="t.q",
        kind="sync",
        title="t",
        trigger="t",
        threshold=0.5,
        query=query,
        change="",
        why="w",
        thresholds={"cut": 0.5},
    )
    assert base.evaluate(None) is not None  # type: ignore[arg-type]
    assert dataclasses.replace(base, thresholds={"cut": 2.0}).evaluate(None) is None  # type: ignore[arg-type]
    assert seen == [0.5, 2.0]
