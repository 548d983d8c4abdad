"""Stored reports, read typed: the one place the server turns ``analyses.report`` into ``ReportDoc``.

The API returns the stored JSON as it is (its schema is the contract's); everything that *reads* a
report (the run aggregate, the dashboard's trace page) decodes it here first and then reads
attributes, so a missing or mistyped field fails in one place instead of being guarded at every
``.get``.

**Is this stale?** is answered here and nowhere else (``is_stale``, ``read_analysis``): a report
written by another engine or schema, or one that does not decode, is stale. Reading never writes:
the API and the pages show a stale report flagged, and re-queueing it is a job of its own
(``runs.diagnosis_job.requeue_outdated``, run by the workers' sweep) or an explicit ``POST .../reanalyze``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from stepdoctor_analysis import ENGINE_VERSION, SCHEMA_VERSION
from stepdoctor_analysis.report.contract import Device, GpuSection, ReportDoc, Tables, decode

log = logging.getLogger(__name__)


def read_report(stored: Mapping[str, Any] | bytes | str | None) -> ReportDoc | None:
    """The stored report as ``ReportDoc``; None when there is none or it is not one (outdated)."""
    if not stored:
        return None
    try:
        return decode(stored if isinstance(stored, bytes | str | dict) else dict(stored))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        log.info("stored report does not match the report contract, treated as outdated: %s", exc)
        return None


def is_stale(engine_version: str | None, schema_version: int | None) -> bool:
    """A report made by another engine or report schema than this one is stale (redone by a job)."""
    return engine_version != ENGINE_VERSION or schema_version != SCHEMA_VERSION


def read_analysis(
    stored: Mapping[str, Any] | None, engine_version: str | None, schema_version: int | None
) -> tuple[ReportDoc | None, bool]:
    """A stored analysis: its report typed (None when there is none or it does not decode) and
    whether it is stale. Writes nothing."""
    if stored is None:
        return None, False
    doc = read_report(stored)
    return doc, doc is None or is_stale(engine_version, schema_version)


class ReportFacts(msgspec.Struct, kw_only=True):
    """The parts of a report the run and trace pages summarise (device, GPU figures, memory per
    device, top tables), typed; the run page reads them as JSON fields, never the whole report."""

    device: Device | None = None
    gpu: GpuSection | None = None
    memory_devices: list[dict[str, Any]] = msgspec.field(default_factory=list)  # free-form section
    tables: Tables | None = None


def read_facts(device: Any, gpu: Any, memory_devices: Any, tables: Any) -> ReportFacts | None:
    """The stored report's parts (as read from its JSON fields) typed; None when one does not
    decode (outdated, as for ``read_report``)."""
    parts = {"device": device, "gpu": gpu, "memory_devices": memory_devices or [], "tables": tables}
    try:
        return msgspec.convert(parts, ReportFacts)
    except msgspec.ValidationError as exc:
        log.info("stored report parts do not match the report contract, treated as outdated: %s", exc)
        return None


def facts_of(doc: ReportDoc) -> ReportFacts:
    """The same parts of a report already read whole."""
    return ReportFacts(
        device=doc.device,
        gpu=doc.metrics.gpu,
        memory_devices=doc.metrics.memory.devices,
        tables=doc.tables,
    )
