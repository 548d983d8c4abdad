"""``stepdoctor mcp``: the diagnosis as tools a coding agent calls, over MCP's stdio transport.

Built on the official ``mcp`` SDK (the ``mcp`` extra; imported only when the server is built, so
the rest of the package imports without it). Every tool answers from the function that answers
the same question elsewhere, so the agent reads the numbers the CLI and the dashboard show:

- ``analyze``: ``pipeline.analyze_path`` (what ``stepdoctor analyze`` prints), or its summary;
- ``run_verdict``, ``step_breakdown``: the run's diagnosis (the server's ``/runs/{id}/diagnosis``,
  locally the report ``stepdoctor analyze RUN`` gives) and its per-step rows;
- ``compare_runs``: ``compare.compare_diagnoses`` (the compare page's numbers), over the server's
  ``/compare`` or over ``run_verdict.run_verdict`` of two local runs;
- ``guide``: a section of docs/verdicts.md (``stepdoctor_analysis.report.guide``, shipped in the wheel).

Two backends: local files (runs are trace files or directories, projects the log directories
under ``--root``), or a server (``--server URL --token T``, default ``STEPDOCTOR_SERVER`` and
``STEPDOCTOR_TOKEN``) whose API decides what the token may read: a token without read scope gets
the server's refusal as a tool error, and the tools never write. Every anticipated failure (a
missing file, a bad trace, an unknown run, a refused token, an unreachable server) is a tool error
of one sentence; nothing reaches the agent as a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx

from stepdoctor_analysis.errors import TraceError
from stepdoctor_analysis.report import guide
from stepdoctor_analysis.run.timeline import Side
from stepdoctor_analysis.run.verdict import RunVerdict

NAME = "stepdoctor"
MAX_TIMELINE_TRACES = 16  # a run's timeline lists at most this many traces' steps
HTTP_TIMEOUT_S = 30.0
T = TypeVar("T")


class ToolFailure(Exception):
    """An anticipated failure, told to the agent as one sentence (an MCP tool error)."""


# -- what every surface says about a report or a run's diagnosis -----------------------------------


def verdict_of(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The verdict of a report or of a run's diagnosis (the two share ``primary`` and
    ``recommendations``): kind, share, gain, first card and where the guide explains them."""
    primary = doc.get("primary") or {}
    cards = doc.get("recommendations") or []
    first = cards[0] if cards else None
    kind = primary.get("kind")
    ranks = doc.get("ranks")
    stragglers = (
        ranks.get("stragglers", [])
        if isinstance(ranks, Mapping)
        else [s.get("rank") for s in doc.get("stragglers") or []]
    )
    return {
        "kind": kind,
        "share": primary.get("share"),
        "gain": primary.get("gain"),
        "basis": primary.get("basis"),
        "note": primary.get("note") or "",
        "step_time_us": doc.get("step_time_us"),
        "guide": guide.link(kind) if kind else None,
        "first_card": None
        if first is None
        else {
            "id": first.get("id"),
            "title": first.get("title"),
            "kind": first.get("kind"),
            "change": first.get("change"),
            "expected_speedup": first.get("expected_speedup"),
            "expected_speedup_range": first.get("expected_speedup_range"),
            "basis": first.get("basis"),
            "guide": guide.link(str(first.get("kind")), first.get("id")),
        },
        "stragglers": stragglers,
    }


def step_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A report's per-step rows: number, duration and µs per kind."""
    return [
        {"number": s.get("number"), "duration_us": s.get("duration_us"), "kinds_us": s.get("kinds") or {}}
        for s in report.get("steps") or []
    ]


def breakdown_of(row: Mapping[str, Any]) -> dict[str, Any]:
    """One step row with each kind's share of the step, largest first."""
    total = float(row.get("duration_us") or 0.0)
    kinds = dict(sorted((row.get("kinds_us") or {}).items(), key=lambda kv: -kv[1]))
    return dict(row) | {
        "kinds_us": kinds,
        "shares": {k: round(v / total, 4) if total > 0 else 0.0 for k, v in kinds.items()},
    }


def _find_step(rows: Sequence[Mapping[str, Any]], step: int, where: str) -> dict[str, Any]:
    row = next((r for r in rows if r.get("number") == step), None)
    if row is None:
        numbers = [r.get("number") for r in rows]
        raise ToolFailure(f"{where} has no step {step}; its steps: {numbers}")
    return breakdown_of(row)


# -- backends ----------------------------------------------------------------------------------------


class Backend(Protocol):
    def describe(self) -> str: ...
    def list_projects(self) -> list[dict[str, Any]]: ...
    def list_runs(self, project: str | None) -> list[dict[str, Any]]: ...
    def run_verdict(self, run: str) -> dict[str, Any]: ...
    def compare_runs(self, base: str, other: str) -> dict[str, Any]: ...
    def step_breakdown(self, run: str, step: int, trace_id: int | None) -> dict[str, Any]: ...


def analyze_report(path: str) -> dict[str, Any]:
    """``stepdoctor analyze PATH``'s report (JSON form)."""
    from stepdoctor_analysis.pipeline import analyze_path

    p = Path(path).expanduser()
    if not p.exists():
        raise ToolFailure(f"{path}: no such file or directory")
    return analyze_path(p).to_dict()


@dataclass(frozen=True)
class LocalBackend:
    """Runs are trace files or directories; projects are the log directories under ``root``."""

    root: Path

    def describe(self) -> str:
        return f"local files under {self.root}"

    def _path(self, run: str) -> Path:
        p = Path(run).expanduser()
        p = p if p.is_absolute() else self.root / p
        if not p.exists():
            raise ToolFailure(f"{run}: no such file or directory (runs are paths, relative to {self.root})")
        return p

    def list_projects(self) -> list[dict[str, Any]]:
        from stepdoctor_analysis.parsing.logdir import has_traces, runs

        folders = [self.root, *sorted(p for p in self.root.iterdir() if p.is_dir())]
        return [
            {"name": str(p.relative_to(self.root)) if p != self.root else ".", "runs": len(runs(p))}
            for p in folders
            if runs(p) or has_traces(p)
        ]

    def list_runs(self, project: str | None) -> list[dict[str, Any]]:
        from stepdoctor_analysis.parsing.logdir import has_traces, runs

        folder = self._path(project) if project else self.root
        found = ([(".", folder)] if has_traces(folder) else []) + runs(folder)
        return [{"run": str(path.relative_to(self.root)) or ".", "name": name} for name, path in found]

    def run_verdict(self, run: str) -> dict[str, Any]:
        report = analyze_report(str(self._path(run)))
        return {"run": run, "verdict": verdict_of(report), "timeline": step_rows(report)}

    def _diagnosis(self, run: str) -> RunVerdict:
        """The run's verdict as every surface builds it (``run_verdict.run_verdict``)."""
        from stepdoctor_analysis import parsing as parse
        from stepdoctor_analysis.pipeline import analyze_trace
        from stepdoctor_analysis.run.ranks import TraceEntry, worker_name
        from stepdoctor_analysis.run.verdict import run_verdict

        traces = parse.load_job(self._path(run))
        entries = [
            TraceEntry(analyze_trace(t).typed(), window=i, worker=worker_name(t.source))
            for i, t in enumerate(traces)
        ]
        return run_verdict(entries)

    def compare_runs(self, base: str, other: str) -> dict[str, Any]:
        from stepdoctor_analysis.run.timeline import NothingComparable, compare
        from stepdoctor_server.runs.compare import compare_diagnoses

        b, o = self._diagnosis(base), self._diagnosis(other)
        try:  # the step times on the basis ``check`` and the compare page use (the engine's compare)
            step = compare(self._side(other, o), self._side(base, b))
        except NothingComparable:
            step = None
        return {"base": base, "other": other, "comparison": compare_diagnoses(b, o, step)}

    def _side(self, run: str, verdict: RunVerdict) -> Side:
        """The run as ``compare`` sees it: its series' steady median (when its folder has one) and
        its verdict's profiled step time and kind."""
        from stepdoctor_analysis.run.timeline import SeriesError, read_run_timeline

        path = self._path(run)
        try:
            timeline = read_run_timeline(path) if path.is_dir() else None
        except SeriesError:
            timeline = None
        return Side(
            source=run,
            unprofiled_median_ms=timeline.unprofiled_median_ms if timeline is not None else None,
            profiled_ms=verdict.step_time_us / 1e3 or None,
            verdict=verdict.primary.kind if verdict.primary else None,
            steps=timeline.steps if timeline is not None else None,
        )

    def step_breakdown(self, run: str, step: int, trace_id: int | None) -> dict[str, Any]:
        report = analyze_report(str(self._path(run)))
        return {"run": run, "step": _find_step(step_rows(report), step, run)}


@dataclass
class RemoteBackend:
    """A stepdoctor server's REST API, with the token's own rights."""

    url: str
    token: str
    client: httpx.Client | None = None  # tests: a TestClient on the app in-process

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self._client = self.client or httpx.Client(base_url=self.url, timeout=HTTP_TIMEOUT_S)

    def describe(self) -> str:
        return f"the server at {self.url}"

    def _get(self, path: str, **params: Any) -> Any:
        try:
            response = self._client.get(
                f"/api/v1{path}",
                params={k: v for k, v in params.items() if v is not None},
                headers={"Authorization": f"Bearer {self.token}"},
            )
        except httpx.HTTPError as exc:
            raise ToolFailure(f"cannot reach the server at {self.url}: {exc}") from None
        if response.status_code >= 400:
            raise ToolFailure(_refusal(response))
        return response.json()

    def _pages(self, path: str, **params: Any) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        cursor = None
        while True:
            page = self._get(path, cursor=cursor, **params)
            items += page.get("items", [])
            cursor = page.get("next")
            if not cursor:
                return items

    @staticmethod
    def _id(run: str) -> int:
        try:
            return int(run)
        except ValueError:
            raise ToolFailure(f"run {run!r}: on a server a run is its numeric id (see list_runs)") from None

    def list_projects(self) -> list[dict[str, Any]]:
        return [{"id": p["id"], "name": p["name"], "runs": p["run_count"]} for p in self._pages("/projects")]

    def list_runs(self, project: str | None) -> list[dict[str, Any]]:
        keep = ("id", "project", "name", "tags", "primary_kind", "trace_count", "created_at")
        return [{k: r.get(k) for k in keep} for r in self._pages("/runs", project=project)]

    def _reports(self, run_id: int, trace_id: int | None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(trace summary, report) of the run's analysed traces (or of ``trace_id`` only)."""
        traces = [t for t in self._pages(f"/runs/{run_id}/traces") if trace_id in (None, t["id"])]
        if trace_id is not None and not traces:
            raise ToolFailure(f"run {run_id} has no trace {trace_id}")
        out = []
        for t in traces[:MAX_TIMELINE_TRACES]:
            if t.get("status") != "done":
                continue
            report = self._get(f"/traces/{t['id']}/report").get("report")
            if report:
                out.append((t, report))
        return out

    def run_verdict(self, run: str) -> dict[str, Any]:
        run_id = self._id(run)
        answer = self._get(f"/runs/{run_id}/diagnosis")
        diagnosis = answer.get("diagnosis") or {}
        if not diagnosis.get("primary"):
            status = answer.get("trace_status") or {}
            raise ToolFailure(f"run {run_id} has no diagnosis yet (traces by status: {status})")
        timeline = [
            {
                "trace_id": t["id"],
                "rank": t.get("rank"),
                "window": t.get("window_index"),
                "steps": step_rows(r),
            }
            for t, r in self._reports(run_id, None)
        ]
        return {
            "run": run_id,
            "stale": answer.get("stale", False),
            "verdict": verdict_of(diagnosis),
            "timeline": timeline,
            "page": f"{self.url}/runs/{run_id}",
        }

    def compare_runs(self, base: str, other: str) -> dict[str, Any]:
        answer = self._get("/compare", base=self._id(base), other=self._id(other))
        return {
            "base": answer["base"]["id"],
            "other": answer["other"]["id"],
            "comparison": answer["comparison"],
            "page": f"{self.url}/compare?base={answer['base']['id']}&other={answer['other']['id']}",
        }

    def step_breakdown(self, run: str, step: int, trace_id: int | None) -> dict[str, Any]:
        run_id = self._id(run)
        for t, report in self._reports(run_id, trace_id):
            rows = step_rows(report)
            if any(r.get("number") == step for r in rows):
                return {
                    "run": run_id,
                    "trace_id": t["id"],
                    "rank": t.get("rank"),
                    "step": _find_step(rows, step, ""),
                }
        raise ToolFailure(f"run {run_id} has no analysed trace with step {step}")


def _refusal(response: httpx.Response) -> str:
    """The server's own error message, with what the status means for this token."""
    try:
        body = response.json()
        message = body.get("detail") or body.get("message") or body.get("error") or response.text
    except ValueError:
        message = response.text
    if isinstance(message, Mapping):
        message = message.get("message") or str(message)
    meaning = {
        401: "the token is not valid (unknown, revoked or expired)",
        403: "the token's scope does not allow this",
        404: "not found for this token's team",
    }.get(response.status_code, "the server refused")
    return f"{meaning} (HTTP {response.status_code}: {str(message)[:300]})"


# -- the MCP server ----------------------------------------------------------------------------------


def _answer(call: Callable[[], T]) -> T:
    """Run a tool body; anticipated failures become one-sentence tool errors."""
    from mcp.server.mcpserver.exceptions import ToolError

    try:
        return call()
    except ToolFailure as exc:
        raise ToolError(str(exc)) from None
    except TraceError as exc:
        raise ToolError(f"not a usable trace: {exc}") from None
    except OSError as exc:
        raise ToolError(f"{exc.filename or 'file'}: {exc.strerror or exc}") from None


def build_server(backend: Backend) -> Any:
    """The MCP server (``mcp.server.mcpserver.MCPServer``) with stepdoctor's tools on ``backend``."""
    from mcp.server.mcpserver import MCPServer

    server = MCPServer(
        NAME,
        instructions="Diagnose PyTorch training steps from profiler traces: the verdict (which kind of "
        "time limits the step), the change to try first, per-step breakdowns, run comparisons, and "
        f"a guide per verdict. Runs and projects come from {backend.describe()}; trace files are "
        "always read locally.",
    )

    @server.tool()
    def analyze(path: str, summary: bool = True) -> dict[str, Any]:
        """Diagnose a PyTorch profiler trace file or a directory of per-rank traces (local files):
        the verdict and first change (summary=True), or the whole report stepdoctor analyze gives."""

        def body() -> dict[str, Any]:
            report = analyze_report(path)
            if not summary:
                return report
            return {
                "source": report.get("source"),
                "steps": len(report.get("steps") or []),
                "verdict": verdict_of(report),
                "warnings": report.get("warnings") or [],
            }

        return _answer(body)

    @server.tool()
    def list_projects() -> dict[str, Any]:
        """The projects this token (or the local root) holds, with their run counts."""
        return _answer(lambda: {"projects": backend.list_projects()})

    @server.tool()
    def list_runs(project: str | None = None) -> dict[str, Any]:
        """The runs, optionally of one project: ids (server) or paths (local) for the other tools."""
        return _answer(lambda: {"runs": backend.list_runs(project)})

    @server.tool()
    def run_verdict(run: str) -> dict[str, Any]:
        """A run's verdict (limiting kind, its share, the gain, the first card, the guide section)
        and its timeline (every profiled step's duration and time per kind)."""
        return _answer(lambda: backend.run_verdict(run))

    @server.tool()
    def compare_runs(base: str, other: str) -> dict[str, Any]:
        """Compare two runs as the dashboard's compare page does: speedup, per-kind deltas,
        findings resolved or new, and whether the first card was followed."""
        return _answer(lambda: backend.compare_runs(base, other))

    @server.tool()
    def step_breakdown(run: str, step: int, trace_id: int | None = None) -> dict[str, Any]:
        """One ProfilerStep of a run: its duration and the µs and share of each kind."""
        return _answer(lambda: backend.step_breakdown(run, step, trace_id))

    @server.tool()
    def verdict_guide(kind: str) -> str:
        """The guide for a verdict kind (input, transfer, launch, memory, sync, communication,
        compute, stragglers): what it means, how it is measured, what to change first, how to verify."""

        def body() -> str:
            try:
                return guide.section(kind)
            except KeyError as exc:
                raise ToolFailure(str(exc.args[0])) from None

        return _answer(body)

    return server


def backend_from(args: argparse.Namespace) -> Backend:
    if args.server and not args.local:
        if not args.token:
            raise SystemExit("stepdoctor mcp: --server needs a token (--token or STEPDOCTOR_TOKEN)")
        return RemoteBackend(args.server, args.token)
    return LocalBackend(Path(args.root).expanduser().resolve())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stepdoctor mcp",
        description="Serve stepdoctor's tools to a coding agent over MCP (stdio). Add to a client as: "
        'command "stepdoctor", args ["mcp"] (with STEPDOCTOR_SERVER/STEPDOCTOR_TOKEN for a server).',
    )
    p.add_argument(
        "--server", default=os.environ.get("STEPDOCTOR_SERVER"), help="server URL (default STEPDOCTOR_SERVER)"
    )
    p.add_argument(
        "--token", default=os.environ.get("STEPDOCTOR_TOKEN"), help="API token (default STEPDOCTOR_TOKEN)"
    )
    p.add_argument("--local", action="store_true", help="use local files even when a server is configured")
    p.add_argument("--root", default=".", help="local mode: the directory runs and projects are found under")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    root = Path(args.root).expanduser()
    if not (args.server and not args.local) and not root.is_dir():
        print(f"stepdoctor mcp: --root {args.root}: not a directory", file=sys.stderr)
        return 2
    try:
        backend = backend_from(args)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    build_server(backend).run("stdio")
    return 0
