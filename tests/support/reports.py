"""Valid reports for unit tests: the contract's ``ReportDoc`` filled with zeros, then overridden.

Tests of the run aggregate or the dashboard care about a few fields (shares, a breakdown, some
recommendations); the server reads every stored report typed, so the rest must still be there.
The zeros are derived from the contract's own types (``msgspec.inspect``), so a field the contract
gains is filled here without editing this file.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
from msgspec import inspect as mi

from stepdoctor_analysis import ENGINE_VERSION, SCHEMA_VERSION
from stepdoctor_analysis.report.contract import Bottleneck, Recommendation, ReportDoc, StepRow, decode
from stepdoctor_analysis.run.verdict import RunCard, RunFinding, RunPrimary, RunVerdict


def _zero(t: mi.Type) -> Any:
    """The smallest valid value of a type: None when it may be None, else 0, "", [], {} or a record."""
    if isinstance(t, mi.Metadata):
        return _zero(t.type)
    if isinstance(t, mi.UnionType):
        if any(isinstance(u, mi.NoneType) for u in t.types):
            return None
        return _zero(t.types[0])
    if isinstance(t, mi.StructType | mi.DataclassType):
        return {f.encode_name: _zero(f.type) for f in t.fields if f.required}
    if isinstance(t, mi.LiteralType):
        return t.values[0]
    if isinstance(t, mi.ListType | mi.TupleType | mi.VarTupleType):
        return []
    if isinstance(t, mi.DictType):
        return {}
    if isinstance(t, mi.BoolType):
        return False
    if isinstance(t, mi.IntType):
        return 0
    if isinstance(t, mi.FloatType):
        return 0.0
    if isinstance(t, mi.StrType):
        return ""
    if isinstance(t, mi.AnyType):
        return None
    raise NotImplementedError(t)


@functools.cache
def _blank(tp: type) -> dict[str, Any]:
    out: dict[str, Any] = _zero(mi.type_info(tp))
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``; nested objects merge, lists and values replace."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def recommendation(id: str, **over: Any) -> dict[str, Any]:
    """A valid recommendation (or finding) ``id``: kind compute, no gain unless ``over`` says so."""
    base = _blank(Recommendation) | {"id": id, "title": id, "kind": "compute", "expected_speedup": 1.0}
    return _merge(base, over)


def steps(n: int, **over: Any) -> list[dict[str, Any]]:
    """``n`` valid step rows numbered from 0."""
    return [_merge(_blank(StepRow), {"number": i, **over}) for i in range(n)]


def report(**over: Any) -> dict[str, Any]:
    """A valid report (it decodes as ``ReportDoc``) of this engine, zeros except for ``over``."""
    base = _blank(ReportDoc) | {
        "schema_version": SCHEMA_VERSION,
        "engine_version": ENGINE_VERSION,
        "primary": _blank(Bottleneck) | {"kind": "compute"},
    }
    out = _merge(base, over)
    decode(out)  # fails here, with the field's name, when ``over`` breaks the contract
    return out


def typed(**over: Any) -> ReportDoc:
    """``report(**over)`` as the contract's type."""
    return msgspec.convert(report(**over), ReportDoc)


def verdict(**over: Any) -> RunVerdict:
    """A run verdict (``run_verdict.RunVerdict``) with ``over``; its primary, cards and findings
    are filled with zeros like a report's, so a test names only the fields it reads."""
    cards = {"primary": RunPrimary, "recommendations": RunCard, "findings": RunFinding}
    fields = dict(over)
    for key, tp in cards.items():
        value = fields.get(key)
        if isinstance(value, dict):
            fields[key] = _merge(_blank(tp), {"reason": "", **value} if tp is RunPrimary else value)
        elif isinstance(value, list):
            # A finding is a report's Recommendation, whose kind must be a bottleneck kind.
            blank = _blank(tp) | ({"kind": "compute"} if tp is RunFinding else {})
            fields[key] = [_merge(blank, v) for v in value]
    return msgspec.convert(fields, RunVerdict)


def server_run(traces: Any, **counts: int) -> dict[str, Any]:
    """The server's run diagnosis (``aggregate.aggregate_run``) as the API returns it (JSON values)."""
    from stepdoctor_server.runs.diagnosis import aggregate_run

    out: dict[str, Any] = msgspec.to_builtins(aggregate_run(traces, **counts))
    return out


def as_verdict(diagnosis: dict[str, Any]) -> RunVerdict:
    """A run diagnosis as the API returns it, typed again (what compare and the pages read)."""
    return msgspec.convert(diagnosis, RunVerdict)
