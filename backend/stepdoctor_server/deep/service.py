"""Deep analyses: the optional HTA jobs of a trace, listed and requested."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from stepdoctor_server.auth.tokens import Principal
from stepdoctor_server.core.errors import ApiError
from stepdoctor_server.core.models import DeepAnalysis
from stepdoctor_server.jobs.claims import request_deep_analysis
from stepdoctor_server.traces.service import load_trace


def deep_analyses(session: Session, trace_id: int) -> list[DeepAnalysis]:
    """A trace's deep analyses, newest first."""
    return list(
        session.scalars(
            select(DeepAnalysis)
            .where(DeepAnalysis.trace_id == trace_id)
            .order_by(DeepAnalysis.created_at.desc(), DeepAnalysis.id.desc())
        )
    )


def request_critical_path(
    session: Session, principal: Principal, trace_id: int, *, step: int | None, force: bool
) -> tuple[DeepAnalysis, bool]:
    """Queue HTA's critical path of one step (idempotent unless ``force``): 404 for others' traces,
    501 without HTA. Returns the job and whether this call queued it."""
    from stepdoctor_analysis.analyzers import deep

    trace, _, _ = load_trace(session, principal, trace_id)
    if not deep.available():
        raise ApiError(
            501,
            "hta_not_installed",
            f"deep analyses need Holistic Trace Analysis on the server: {deep.INSTALL_HINT}",
        )
    params: dict[str, Any] = {} if step is None else {"step": step}
    return request_deep_analysis(session, trace.id, "critical_path", params, force=force)
