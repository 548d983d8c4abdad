"""``stepdoctor mcp``: every tool answered through the MCP SDK's own client, in-process, on local
trace files and against the real app with tokens of each scope; failures are tool errors."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

pytest.importorskip("mcp")
from mcp import Client

from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_analysis.report import guide
from stepdoctor_server.mcp_server import Backend, LocalBackend, RemoteBackend, build_server
from support.server import drain, upload
from support.synthetic import launch_bound_trace, sync_bound_trace

TOOLS = {
    "analyze",
    "list_projects",
    "list_runs",
    "run_verdict",
    "compare_runs",
    "step_breakdown",
    "verdict_guide",
}


def _call(backend: Backend, *calls: tuple[str, dict[str, Any]]) -> list[Any]:
    """Each (tool, arguments) through the SDK client connected in-process to the server."""

    async def run() -> list[Any]:
        async with Client(build_server(backend)) as client:
            listed = await client.list_tools()
            assert {t.name for t in listed.tools} == TOOLS
            return [await client.call_tool(name, args) for name, args in calls]

    return asyncio.run(run())


def _ok(result: Any) -> Any:
    assert not result.is_error, result.content[0].text
    return result.structured_content.get("result", result.structured_content)


def _error(result: Any) -> str:
    assert result.is_error
    text: str = result.content[0].text
    assert "Traceback" not in text and "\n" not in text.strip()
    return text


@pytest.fixture
def logdir(tmp_path: Path) -> Path:
    """A TensorBoard-style log dir of two runs: a sync-bound one, and a launch-bound one."""
    for name, make in (("sync", sync_bound_trace), ("launch", launch_bound_trace)):
        (tmp_path / "proj" / name).mkdir(parents=True)
        make(tmp_path / "proj" / name / "host_1.1.pt.trace.json")
    return tmp_path


def test_local_tools_answer_what_the_cli_reports(logdir: Path) -> None:
    sync_run = "proj/sync"
    expected = analyze_path(logdir / sync_run).to_dict()
    summary, full, projects, runs, verdict, compared, step, section = _call(
        LocalBackend(logdir),
        ("analyze", {"path": str(logdir / sync_run)}),
        ("analyze", {"path": str(logdir / sync_run), "summary": False}),
        ("list_projects", {}),
        ("list_runs", {"project": "proj"}),
        ("run_verdict", {"run": sync_run}),
        ("compare_runs", {"base": sync_run, "other": "proj/launch"}),
        ("step_breakdown", {"run": sync_run, "step": expected["steps"][1]["number"]}),
        ("verdict_guide", {"kind": "sync"}),
    )
    v = _ok(summary)["verdict"]
    assert v["kind"] == expected["primary"]["kind"] == "sync"
    assert v["share"] == expected["primary"]["share"] and v["gain"] == expected["primary"]["gain"]
    assert v["first_card"]["id"] == expected["recommendations"][0]["id"]
    assert v["guide"] == "docs/verdicts.md#sync"
    assert _ok(full)["step_time_us"] == expected["step_time_us"]
    assert {"name": "proj", "runs": 2} in _ok(projects)["projects"]
    assert [r["run"] for r in _ok(runs)["runs"]] == ["proj/launch", "proj/sync"]
    got = _ok(verdict)
    assert got["verdict"] == v and len(got["timeline"]) == len(expected["steps"])
    comparison = _ok(compared)["comparison"]
    assert comparison["primary"]["base"] == "sync" and comparison["primary"]["other"] == "launch"
    row = _ok(step)["step"]
    assert row["duration_us"] == pytest.approx(expected["steps"][1]["duration_us"])
    assert sum(row["kinds_us"].values()) == pytest.approx(row["duration_us"], rel=0.02)
    assert _ok(section) == guide.section("sync")


def test_local_failures_are_one_sentence_tool_errors(logdir: Path) -> None:
    (logdir / "junk.json").write_text("{not json")
    missing, junk, no_run, no_step, no_kind = _call(
        LocalBackend(logdir),
        ("analyze", {"path": str(logdir / "nope.json")}),
        ("analyze", {"path": str(logdir / "junk.json")}),
        ("run_verdict", {"run": "proj/absent"}),
        ("step_breakdown", {"run": "proj/sync", "step": 999}),
        ("verdict_guide", {"kind": "gpu"}),
    )
    assert "no such file or directory" in _error(missing)
    assert "not a usable trace: junk.json: not valid JSON" in _error(junk)
    assert "proj/absent: no such file" in _error(no_run)
    assert "has no step 999" in _error(no_step)
    assert "no guide section 'gpu'; known: input, transfer" in _error(no_kind)


def _uploaded(
    client: TestClient, app: FastAPI, token: str, run: str, make: Callable[[Path], Path], tmp: Path
) -> int:
    trace = make(tmp / f"{run}.json")
    body = gzip.compress(trace.read_bytes())
    answer = upload(client, body, token=token, run=run)
    assert answer.status_code == 201, answer.text
    drain(app)
    return int(answer.json()["run_id"])


@pytest.mark.only_db("sqlite")
def test_remote_tools_answer_what_the_api_answers(
    app: FastAPI, client: TestClient, make_token: Callable[..., str], tmp_path: Path
) -> None:
    admin = make_token("admin")
    slow = _uploaded(client, app, admin, "slow", sync_bound_trace, tmp_path)
    fast = _uploaded(client, app, admin, "fast", launch_bound_trace, tmp_path)
    read = make_token("read")
    api = {"Authorization": f"Bearer {read}"}
    diagnosis = client.get(f"/api/v1/runs/{slow}/diagnosis", headers=api).json()["diagnosis"]
    compared = client.get("/api/v1/compare", params={"base": slow, "other": fast}, headers=api).json()

    backend = RemoteBackend("http://testserver", read, client=client)
    projects, runs, verdict, comparison, step, bad_id = _call(
        backend,
        ("list_projects", {}),
        ("list_runs", {"project": "proj"}),
        ("run_verdict", {"run": str(slow)}),
        ("compare_runs", {"base": str(slow), "other": str(fast)}),
        ("step_breakdown", {"run": str(slow), "step": 1}),
        ("run_verdict", {"run": "slow"}),
    )
    assert [p["name"] for p in _ok(projects)["projects"]] == ["proj"]
    assert {r["id"] for r in _ok(runs)["runs"]} == {slow, fast}
    v = _ok(verdict)
    assert v["verdict"]["kind"] == diagnosis["primary"]["kind"] == "sync"
    assert v["verdict"]["gain"] == diagnosis["primary"]["gain"]
    assert v["verdict"]["first_card"]["id"] == diagnosis["recommendations"][0]["id"]
    assert v["timeline"] and v["timeline"][0]["steps"] and v["page"].endswith(f"/runs/{slow}")
    assert _ok(comparison)["comparison"] == compared["comparison"]
    assert _ok(step)["step"]["number"] == 1
    assert "numeric id" in _error(bad_id)

    # The token's scope and team decide, not the tool: an upload token may not read, another
    # team's token does not see this team's runs, a revoked or made-up token is refused.
    (refused,) = _call(
        RemoteBackend("http://testserver", make_token("upload"), client=client), ("list_runs", {})
    )
    assert "scope does not allow" in _error(refused) and "HTTP 403" in _error(refused)
    other_team = make_token("read", team_name="others")
    (hidden,) = _call(
        RemoteBackend("http://testserver", other_team, client=client), ("run_verdict", {"run": str(slow)})
    )
    assert "HTTP 404" in _error(hidden)
    (bogus,) = _call(
        RemoteBackend("http://testserver", "sdt_" + "x" * 40, client=client), ("list_projects", {})
    )
    assert "HTTP 401" in _error(bogus)


def test_an_unreachable_server_is_a_tool_error() -> None:
    (result,) = _call(RemoteBackend("http://127.0.0.1:9", "sdt_x"), ("list_projects", {}))
    assert "cannot reach the server at http://127.0.0.1:9" in _error(result)


def test_mcp_command_starts_over_stdio(logdir: Path) -> None:
    """The console script's ``mcp`` command, spoken to by the SDK's stdio client."""
    import sys

    from mcp.client.stdio import StdioServerParameters

    params = StdioServerParameters(
        command=sys.executable, args=["-m", "stepdoctor", "mcp", "--local", "--root", str(logdir)]
    )

    async def run() -> Any:
        async with Client(params) as client:
            return await client.call_tool("list_runs", {})

    result = asyncio.run(asyncio.wait_for(run(), timeout=300))
    assert [r["run"] for r in _ok(result)["runs"]] == ["proj/launch", "proj/sync"]
    assert json.loads(result.content[0].text)


def test_local_compare_uses_the_unprofiled_steady_state_when_both_runs_have_a_series(logdir: Path) -> None:
    """The compare page's basis (the engine's compare, as ``check``): each run folder gets a step
    series (60 and 40 ms steady steps); the comparison says ``unprofiled`` and measures 1.5x on it."""
    from stepdoctor_analysis.run.timeline import SUFFIX
    from support.regressions import series_chunk

    for name, ms in (("sync", 60.0), ("launch", 40.0)):
        (logdir / "proj" / name / f"host_1.0{SUFFIX}").write_bytes(series_chunk(200, ms))
    (compared,) = _call(LocalBackend(logdir), ("compare_runs", {"base": "proj/sync", "other": "proj/launch"}))
    comparison = _ok(compared)["comparison"]
    assert comparison["step"]["basis"] == "unprofiled" and comparison["speedup"] == pytest.approx(1.5)
    assert (comparison["step"]["base_ms"], comparison["step"]["other_ms"]) == (60.0, 40.0)
