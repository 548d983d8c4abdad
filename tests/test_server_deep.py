"""Deep (HTA) analyses through the server: request -> deep queue -> worker -> stored result -> page.

Runs on SQLite and PostgreSQL (the ``db_url`` fixture). Jobs are drained in-process with
``worker.process_one``, the same code a worker process runs: it turns to deep jobs once no trace
waits. Expected results come from ``deep.critical_path`` run directly on the same fixture file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select

from stepdoctor_analysis.analyzers import deep
from stepdoctor_dashboard import figures
from stepdoctor_server.core.models import DeepAnalysis
from stepdoctor_server.jobs.claims import SqlDeepQueue, SqlJobQueue
from support.server import FIXTURE_TRACES, bearer, drain, upload

CP = FIXTURE_TRACES / "hta" / "critical_path"
EVENT_SYNC = CP / "cuda_event_sync" / "event_sync_trace.json.gz"
SIMPLE_ADD = CP / "simple_add" / "benchmark_result_493459_1694039959_trace.json.gz"
CPU_ONLY = FIXTURE_TRACES / "hta" / "cpu_only" / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"

needs_hta = pytest.mark.skipif(not deep.available(), reason="HolisticTraceAnalysis (stepdoctor[hta]) missing")


@pytest.fixture(scope="module")
def expected() -> dict[str, dict[str, Any]]:
    """``deep.critical_path`` run directly on the fixtures: what the server must store."""
    if not deep.available():
        pytest.skip("HolisticTraceAnalysis missing")
    return {
        "event_sync": deep.critical_path(EVENT_SYNC, rank=0),
        "simple_add": deep.critical_path(SIMPLE_ADD),
    }


def _upload(client: TestClient, path: Path, *, run: str = "run1", rank: int | None = 0) -> dict[str, Any]:
    resp = upload(client, path.read_bytes(), run=run, rank=rank)
    assert resp.status_code == 201, resp.text
    body: dict[str, Any] = resp.json()
    return body


def _request(client: TestClient, trace_id: int, query: str = "", **kw: Any) -> httpx.Response:
    return client.post(f"/api/v1/traces/{trace_id}/deep/critical-path{query}", **kw)


def _jobs(client: TestClient, trace_id: int) -> list[dict[str, Any]]:
    resp = client.get(f"/api/v1/traces/{trace_id}/deep")
    assert resp.status_code == 200, resp.text
    jobs: list[dict[str, Any]] = resp.json()
    return jobs


@needs_hta
def test_request_run_and_read_a_critical_path(
    client: TestClient, app: FastAPI, expected: dict[str, dict[str, Any]]
) -> None:
    trace = _upload(client, EVENT_SYNC)
    resp = _request(client, trace["id"])
    assert resp.status_code == 202, resp.text
    job = resp.json()
    assert (job["status"], job["kind"], job["params"], job["result"]) == (
        "pending",
        "critical_path",
        {},
        None,
    )
    assert [j["id"] for j in _jobs(client, trace["id"])] == [job["id"]]

    assert drain(app) == 2  # the trace's own analysis first, then the deep job
    (done,) = _jobs(client, trace["id"])
    assert done["status"] == "done" and done["status_reason"] is None and done["attempts"] == 1
    want = expected["event_sync"]
    assert done["result"]["length_us"] == pytest.approx(want["length_us"])
    assert list(done["result"]["breakdown"]) == list(want["breakdown"])
    assert done["result"]["breakdown"] == pytest.approx(want["breakdown"])
    assert [r["name"] for r in done["result"]["top"]] == [r["name"] for r in want["top"]]
    filename = client.get(f"/api/v1/traces/{trace['id']}").json()["filename"]
    assert done["result"]["source"] == filename  # the download name, never our storage key

    again = _request(client, trace["id"])
    assert again.status_code == 200 and again.json()["id"] == job["id"] and again.json()["status"] == "done"
    assert drain(app) == 0  # nothing was queued by the repeat

    forced = _request(client, trace["id"], "?force=true")
    assert forced.status_code == 202 and forced.json()["id"] == job["id"]
    assert forced.json()["status"] == "pending" and forced.json()["result"] is None
    assert drain(app) == 1
    assert _jobs(client, trace["id"])[0]["status"] == "done"

    # Another step is another job; an unknown step fails with the engine's one-line reason.
    other = _request(client, trace["id"], f"?step={want['step']}")
    missing = _request(client, trace["id"], "?step=999999")
    assert other.status_code == missing.status_code == 202
    assert len({job["id"], other.json()["id"], missing.json()["id"]}) == 3
    assert drain(app) == 2
    by_id = {j["id"]: j for j in _jobs(client, trace["id"])}
    assert by_id[other.json()["id"]]["result"]["length_us"] == pytest.approx(want["length_us"])
    failed = by_id[missing.json()["id"]]
    assert failed["status"] == "failed" and "ProfilerStep#999999" in failed["status_reason"]


@needs_hta
def test_untraceable_trace_fails_alone_and_the_next_job_runs(
    client: TestClient, app: FastAPI, expected: dict[str, dict[str, Any]]
) -> None:
    cpu = _upload(client, CPU_ONLY, run="cpu", rank=None)
    gpu = _upload(client, SIMPLE_ADD, run="gpu")
    first = _request(client, cpu["id"])
    second = _request(client, gpu["id"])
    assert first.status_code == second.status_code == 202
    drain(app)
    (failed,) = _jobs(client, cpu["id"])
    assert failed["status"] == "failed" and failed["result"] is None
    reason = failed["status_reason"]
    assert reason and "\n" not in reason and "GPU" in reason and not reason.startswith("internal error")
    assert reason.startswith(client.get(f"/api/v1/traces/{cpu['id']}").json()["filename"])
    (done,) = _jobs(client, gpu["id"])
    assert done["status"] == "done"
    assert done["result"]["length_us"] == pytest.approx(expected["simple_add"]["length_us"])

    retry = _request(client, cpu["id"])  # a failed job is retried on request, with fresh attempts
    assert retry.status_code == 202 and retry.json()["id"] == first.json()["id"]
    assert retry.json()["status"] == "pending" and retry.json()["attempts"] == 0


def test_other_teams_and_read_tokens(client: TestClient, make_token: Any, read_token: str) -> None:
    trace = _upload(client, EVENT_SYNC)
    stranger = bearer(make_token("admin", team_name="elsewhere"))
    assert _request(client, trace["id"], headers=stranger).status_code == 404
    assert client.get(f"/api/v1/traces/{trace['id']}/deep", headers=stranger).status_code == 404
    assert _request(client, 999_999).status_code == 404
    # Reading is enough to see results, not to spend a worker on a new analysis.
    assert client.get(f"/api/v1/traces/{trace['id']}/deep", headers=bearer(read_token)).json() == []
    assert _request(client, trace["id"], headers=bearer(read_token)).status_code == 403
    assert _request(client, trace["id"], "?step=-1").status_code == 422


def test_without_hta_the_request_is_a_clear_501(
    client: TestClient, app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = _upload(client, EVENT_SYNC)
    monkeypatch.setattr(deep, "available", lambda: False)
    resp = _request(client, trace["id"])
    assert resp.status_code == 501
    error = resp.json()["error"]
    assert error["code"] == "hta_not_installed" and "stepdoctor[hta]" in error["message"]
    assert _jobs(client, trace["id"]) == []


def test_a_worker_without_hta_fails_the_job_with_the_install_hint(
    client: TestClient, app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = _upload(client, EVENT_SYNC)
    if not deep.available():
        pytest.skip("HolisticTraceAnalysis missing")
    assert _request(client, trace["id"]).status_code == 202
    monkeypatch.setattr(deep, "available", lambda: False)  # e.g. a worker host without the extra
    drain(app)
    (job,) = _jobs(client, trace["id"])
    assert job["status"] == "failed" and "stepdoctor[hta]" in job["status_reason"]


def test_a_dead_workers_deep_job_is_requeued(client: TestClient, app: FastAPI) -> None:
    trace = _upload(client, EVENT_SYNC)
    if not deep.available():
        pytest.skip("HolisticTraceAnalysis missing")
    job_id = _request(client, trace["id"]).json()["id"]
    db = app.state.db
    assert SqlDeepQueue(db).claim("gone:1:0") == job_id
    assert SqlDeepQueue(db).claim("other:1:0") is None  # claimed once only
    assert SqlJobQueue(db).requeue_worker("gone:1:0") == 1
    with db.session() as session:
        row = session.scalars(select(DeepAnalysis).where(DeepAnalysis.id == job_id)).one()
        assert (row.status, row.claimed_by, row.attempts) == ("pending", None, 1)


# -- dashboard -----------------------------------------------------------------------------------


def test_critical_path_figure_orders_bound_types_in_ms() -> None:
    result = {
        "step": 7,
        "breakdown": {"gpu_compute": 3000.0, "cpu": 500.0, "zzz_new": 1.0, "launch_overhead": 250.0},
        "shares": {"gpu_compute": 0.8, "cpu": 0.13, "launch_overhead": 0.07},
    }
    fig = figures.critical_path_figure(result)
    assert list(fig.data[0].x) == ["launch_overhead", "cpu", "gpu_compute", "zzz_new"]
    assert list(fig.data[0].y) == [0.25, 0.5, 3.0, 0.001]
    assert list(fig.data[0].customdata)[2] == pytest.approx(80.0)
    assert "step 7" in fig.layout.title.text


@needs_hta
def test_trace_page_button_runs_and_shows_the_critical_path(
    client: TestClient, app: FastAPI, admin_token: str, read_token: str
) -> None:
    trace = _upload(client, EVENT_SYNC)
    with TestClient(app) as browser:
        login = browser.post(
            "/login",
            content=f"token={admin_token}&next=/",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
            follow_redirects=False,
        )
        assert login.status_code == 303
        before = browser.get(f"/traces/{trace['id']}")
        assert "Critical path (HTA)" in before.text and "plot-critical_path" not in before.text
        pressed = browser.post(
            f"/traces/{trace['id']}/deep/critical-path",
            content="step=",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
            follow_redirects=False,
        )
        assert pressed.status_code == 303 and pressed.headers["location"].startswith(f"/traces/{trace['id']}")
        status = browser.get(f"/traces/{trace['id']}").text.split('id="critical-path-status">', 1)[1]
        assert status.split("</p>", 1)[0].endswith(": pending")
        drain(app)
        page = browser.get(f"/traces/{trace['id']}")
    (job,) = _jobs(client, trace["id"])
    plot = _plot(page.text, "plot-critical_path")
    shown = dict(zip(plot["data"][0]["x"], plot["data"][0]["y"], strict=True))
    for bound, us in job["result"]["breakdown"].items():
        assert shown[bound] == pytest.approx(us / 1000.0)
    assert 'id="critical-path-top"' in page.text
    assert job["result"]["top"][0]["name"].replace("&", "&amp;") in page.text

    with TestClient(app) as reader:  # a read-only viewer sees the result but has no button
        reader.post(
            "/login",
            content=f"token={read_token}&next=/",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        seen = reader.get(f"/traces/{trace['id']}")
        assert "plot-critical_path" in seen.text and "Analyse the critical path" not in seen.text
        refused = reader.post(f"/traces/{trace['id']}/deep/critical-path", content="")
        assert refused.status_code == 403


def _plot(html: str, name: str) -> dict[str, Any]:
    chunk = html.split(f'type="application/json" data-plot="{name}">', 1)[1]
    plot: dict[str, Any] = json.loads(chunk.split("</script>", 1)[0])
    return plot
