"""The team dashboard: figures from stored diagnoses, cookie login, pages, downloads, a real browser."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_dashboard import figures
from support.dashboard import launch_chromium, page_plots
from support.reports import steps, typed
from support.server import FIXTURE_TRACES, cli_token, drain, serve_subprocess, upload

# A trace with a clear verdict (host synchronisation) and one with almost nothing in it.
BASE = (
    FIXTURE_TRACES
    / "hta"
    / "critical_path"
    / "simple_add"
    / "benchmark_result_493459_1694039959_trace.json.gz"
)
OTHER = FIXTURE_TRACES / "hta" / "trace_compare" / "test" / "test.json.gz"


# -- figures (pure) ------------------------------------------------------------------------------


def test_breakdown_figure_stacks_every_category_in_priority_order() -> None:
    breakdown = {"other": 50.0, "kernel": 1500.0, "dataloader": 3000.0, "memcpy": 250.0}
    fig = figures.breakdown_figure(breakdown)
    names = [trace.name for trace in fig.data]
    assert names == ["kernel", "memcpy", "dataloader", "other"]
    assert [trace.x[0] for trace in fig.data] == [1.5, 0.25, 3.0, 0.05]  # µs -> ms
    assert fig.layout.barmode == "stack"


def test_compare_figure_pairs_base_and_other() -> None:
    comparison = {"categories": {"kernel": {"base_us": 2000.0, "other_us": 1000.0}}}
    fig = figures.compare_figure(comparison, "before", "after")
    assert [t.name for t in fig.data] == ["before", "after"]
    assert [t.y[0] for t in fig.data] == [2.0, 1.0]


def test_steps_figure_stacks_the_attributed_kinds_per_step() -> None:
    report = typed(steps=steps(1, number=7, kinds={"input": 3000.0, "compute": 1000.0, "sync": 0.0}))
    fig = figures.steps_figure(report.steps)
    assert {t.name: t.y[0] for t in fig.data} == {"input": 3.0, "compute": 1.0}
    assert list(fig.data[0].x) == ["7"]


def test_memory_figure_only_when_the_trace_had_memory_events() -> None:
    assert figures.memory_figure({}) is None
    fig = figures.memory_figure(
        {"curves": [{"device": "cuda:0", "t_us": [0, 1000], "allocated": [0, 2**21]}]}
    )
    assert isinstance(fig, figures.Fig)
    assert list(fig.data[0].y) == [0.0, 2.0]


# -- pages ---------------------------------------------------------------------------------------


def _login(client: TestClient, token: str) -> httpx.Response:
    return client.post(
        "/login",
        content=f"token={token}&next=/",
        headers={"Content-Type": "application/x-www-form-urlencoded", "Authorization": ""},
        follow_redirects=False,
    )


@pytest.fixture
def analysed_runs(client: TestClient, app: FastAPI) -> dict[str, Any]:
    ids = {}
    for run, path in (("before", BASE), ("after", OTHER)):
        resp = upload(client, path.read_bytes(), project="vision", run=run, metadata={"tags": ["demo"]})
        assert resp.status_code == 201, resp.text
        ids[run] = resp.json()
    drain(app)
    return ids


def test_pages_need_a_login(app: FastAPI) -> None:
    with TestClient(app) as anonymous:
        for path in ("/", "/runs/1", "/projects/1", "/traces/1/download"):
            resp = anonymous.get(path, follow_redirects=False)
            assert resp.status_code == 303, path
            assert resp.headers["location"].startswith("/login")


def test_login_refuses_unknown_and_upload_only_tokens(app: FastAPI, upload_token: str) -> None:
    with TestClient(app) as anonymous:
        for token in ("sdt_not-a-token", upload_token):
            resp = _login(anonymous, token)
            assert resp.status_code == 401
            assert "stepdoctor_token" not in resp.cookies
            assert 'role="alert"' in resp.text


def test_run_trace_and_compare_pages(app: FastAPI, analysed_runs: dict[str, Any], read_token: str) -> None:
    with TestClient(app) as browser:
        assert _login(browser, read_token).status_code == 303
        home = browser.get("/")
        assert home.status_code == 200 and "vision" in home.text and "before" in home.text

        run_id = analysed_runs["before"]["run_id"]
        api_run = browser.get(
            f"/api/v1/runs/{run_id}", headers={"Authorization": f"Bearer {read_token}"}
        ).json()
        page = browser.get(f"/runs/{run_id}")
        assert page.status_code == 200
        kind = api_run["diagnosis"]["primary"]["kind"]
        assert f">{kind}</strong>:" in page.text.split('id="verdict"', 1)[1]
        first = api_run["diagnosis"]["recommendations"][0]["title"]
        assert "Next optimization" in page.text and first.split()[0] in page.text
        plots = page_plots(page.text)
        assert "plot-breakdown" in plots
        shown = {t["name"]: t["x"][0] for t in plots["plot-breakdown"]["data"]}
        for category, us in api_run["diagnosis"]["breakdown"].items():
            if us:
                assert shown[category] == pytest.approx(us / 1000.0)

        trace_id = analysed_runs["before"]["id"]
        assert browser.get(f"/traces/{trace_id}").status_code == 200
        download = browser.get(f"/traces/{trace_id}/download")
        assert download.content == BASE.read_bytes()

        other_id = analysed_runs["after"]["run_id"]
        compare = browser.get(f"/compare?base={run_id}&other={other_id}")
        assert compare.status_code == 200 and "plot-compare" in compare.text
        assert "faster" in compare.text or "slower" in compare.text


def test_other_teams_objects_are_not_found(
    app: FastAPI, analysed_runs: dict[str, Any], make_token: Any
) -> None:
    stranger = make_token("read", team_name="elsewhere")
    with TestClient(app) as browser:
        assert _login(browser, stranger).status_code == 303
        run_id = analysed_runs["before"]["run_id"]
        assert browser.get(f"/runs/{run_id}").status_code == 404
        assert browser.get(f"/traces/{analysed_runs['before']['id']}/download").status_code == 404
        assert "vision" not in browser.get("/").text


def test_names_are_escaped(client: TestClient, app: FastAPI, read_token: str) -> None:
    resp = upload(client, BASE.read_bytes(), project="p", run="r", metadata={"tags": ["<script>x</script>"]})
    assert resp.status_code == 201
    with TestClient(app) as browser:
        _login(browser, read_token)
        page = browser.get("/")
        assert "<script>x</script>" not in page.text
        assert "&lt;script&gt;" in page.text


# -- a real browser ------------------------------------------------------------------------------


@pytest.mark.browser
@pytest.mark.slow
def test_dashboard_in_chromium(tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    env = {"STEPDOCTOR_DATA_DIR": str(tmp_path / "data"), "STEPDOCTOR_WORKERS": "1"}
    env.pop("STEPDOCTOR_DATABASE_URL", None)
    with serve_subprocess({**env, "STEPDOCTOR_DATABASE_URL": ""}) as server:
        token = cli_token(env, "admin")
        with httpx.Client(base_url=server.url, timeout=30) as api:
            resp = upload(api, BASE.read_bytes(), token=token, project="vision", run="before")
            assert resp.status_code == 201, resp.text
            run_id, trace_id = resp.json()["run_id"], resp.json()["id"]
            _wait_done(api, token, trace_id)
        outside: list[str] = []
        with playwright.sync_playwright() as pw:
            browser = launch_chromium(pw)
            page = browser.new_page()
            page.on("request", lambda r: None if r.url.startswith(server.url) else outside.append(r.url))
            page.goto(f"{server.url}/runs/{run_id}")
            assert "/login" in page.url
            page.fill("input[name=token]", token)
            page.click("button[type=submit]")
            page.wait_for_selector("#plot-breakdown .main-svg", timeout=20_000)
            verdict = page.inner_text("#verdict")
            assert "Bound by" in verdict
            bars = page.locator("#plot-breakdown .trace.bars").count()
            assert bars >= 2
            page.screenshot(path=str(tmp_path / "run.png"), full_page=True)
            browser.close()
        assert not outside, f"the dashboard fetched from outside the server: {outside}"
        assert (tmp_path / "run.png").stat().st_size > 10_000


def _wait_done(api: httpx.Client, token: str, trace_id: int, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = api.get(f"/api/v1/traces/{trace_id}", headers={"Authorization": f"Bearer {token}"}).json()[
            "status"
        ]
        if status in {"done", "failed"}:
            assert status == "done"
            return
        time.sleep(0.3)
    raise AssertionError("analysis did not finish")


def test_trace_page_draws_the_memory_curve(
    client: TestClient, app: FastAPI, read_token: str, tmp_path: Path
) -> None:
    from support.synthetic import allocator_churn_trace

    body = allocator_churn_trace(tmp_path / "churn.json.gz").read_bytes()
    trace_id = upload(client, body, project="mem", run="churn").json()["id"]
    drain(app)
    with TestClient(app) as browser:
        _login(browser, read_token)
        page = browser.get(f"/traces/{trace_id}")
    plots = page_plots(page.text)
    assert {"plot-breakdown", "plot-steps", "plot-memory"} <= set(plots)
    allocated = next(t for t in plots["plot-memory"]["data"] if t["name"].endswith("allocated"))
    # The builder's peak total is 90% of an A100's memory; the figure is in MiB.
    assert max(allocated["y"]) == pytest.approx(int(85_899_345_920 * 0.9) / 2**20)


def test_compare_page_explains_a_run_not_analysed_yet(
    client: TestClient, app: FastAPI, read_token: str
) -> None:
    done = upload(client, BASE.read_bytes(), project="vision", run="done").json()
    drain(app)
    waiting = upload(client, OTHER.read_bytes(), project="vision", run="waiting").json()  # left pending
    with TestClient(app) as browser:
        _login(browser, read_token)
        page = browser.get(f"/compare?base={done['run_id']}&other={waiting['run_id']}")
    assert page.status_code == 200
    assert "has no analysed traces yet" in page.text
    assert "plot-compare" not in page.text
