"""``GET /traces/{id}/download?steps=5-6``: one step or a range of a stored trace, as a smaller trace.

The cut (``stepdoctor_analysis.parsing.trim``) streams the stored file into a temporary gzip file that is
deleted once sent, so a trace too big for a viewer can still be opened one step at a time.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fastapi import Request
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from stepdoctor_analysis.errors import TraceError, TraceTooLarge
from stepdoctor_analysis.parsing.trim import no_step_message, parse_steps, trim_trace
from stepdoctor_analysis.report.contract import ReportDoc
from stepdoctor_server.core.errors import ApiError
from stepdoctor_server.core.models import Trace


def requested_steps(steps: str) -> tuple[int, int]:
    """``?steps=`` as (first, last), or a 422: checked before the trace is fetched from the store."""
    try:
        return parse_steps(steps)
    except ValueError as exc:
        raise ApiError(422, "invalid_steps", str(exc)) from None


def marker_steps(doc: ReportDoc) -> list[int] | None:
    """The ProfilerStep numbers a trace's report implies, or None when it cannot say for sure.

    The report lists its steady steps; the warm-up steps before them are counted, not numbered.
    Markers number steps consecutively, so consecutive steady numbers and a warm-up count give
    every number; anything else (no markers, gaps) is left to the cut itself, after the fetch.
    """
    iterations = doc.iterations
    numbers = [s.number for s in doc.steps]
    if iterations is None or iterations.source != "markers" or not numbers:
        return None
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        return None
    return list(range(numbers[0] - iterations.warmup.count, numbers[-1] + 1))


def check_steps_in_report(trace: Trace, doc: ReportDoc | None, steps: tuple[int, int]) -> None:
    """A 422 for steps the stored report shows the trace does not have, before the file is fetched."""
    numbers = marker_steps(doc) if doc is not None else None
    first, last = steps
    if numbers is not None and not any(first <= n <= last for n in numbers):
        raise ApiError(422, "cannot_trim", no_step_message(f"trace {trace.id}", first, last, numbers))


def trimmed_download(trace: Trace, path: Path, steps: tuple[int, int], request: Request) -> FileResponse:
    """Messages name the trace by id and the file by its download name, never the storage key or
    the temporary file (the gzip header records the download's name too)."""
    first, last = steps
    span = f"{first}" if first == last else f"{first}-{last}"
    base = trace.filename.removesuffix(".gz").removesuffix(".json").removesuffix(".pt.trace")
    filename = f"{base}_steps{span}.pt.trace.json.gz"
    max_bytes = getattr(request.app.state.settings, "max_decompressed_bytes", None)
    fd, name = tempfile.mkstemp(prefix="stepdoctor-trim-", suffix=".json.gz")
    os.close(fd)
    out = Path(name)
    try:
        result = trim_trace(
            path, out, first, last, max_bytes=max_bytes, label=f"trace {trace.id}", download_name=filename
        )
    except TraceTooLarge as exc:
        out.unlink(missing_ok=True)
        raise ApiError(413, "too_large", str(exc)) from None
    except TraceError as exc:
        out.unlink(missing_ok=True)
        raise ApiError(422, "cannot_trim", str(exc)) from None
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return FileResponse(
        out,
        media_type="application/gzip",
        filename=filename,
        headers={
            "X-Trimmed-Events": f"{result.kept}/{result.kept + result.dropped}",
            "Cache-Control": "private",
        },
        background=BackgroundTask(out.unlink, missing_ok=True),
    )
