"""Stored reports, read typed: the one place the server turns ``analyses.report`` into ``ReportDoc``.

The API returns the stored JSON as it is (its schema is the contract's); everything that *reads* a
report (the run aggregate, the dashboard's trace page) decodes it here first and then reads
attributes, so a missing or mistyped field fails in one place instead of being guarded at every
``.get``. A stored report that does not decode was written by another engine or schema: it counts as
outdated, like ``queue.is_outdated``: aggregates skip it and pages show it as being re-analysed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from stepdoctor_analysis.contract import ReportDoc, decode

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
