"""The dashboard in Debian's Chromium (Playwright): what a user sees, with a screenshot of each page.

Set ``STEPDOCTOR_SCREENSHOTS=DIR`` to keep the screenshots for review; otherwise they go to tmp_path.
"""

from __future__ import annotations

import gzip
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from stepdoctor_analysis import parsing as parse
from stepdoctor_analysis.model import steps
from stepdoctor_server.core.models import Project, Run, Team
from support.dashboard import analyse_queued, launch_chromium
from support.fixtures import HTA_TRACES
from support.server import cli_token, migrated_sqlite_env, serve_subprocess, upload

TWO_STEPS = HTA_TRACES / "trace_filter" / "sampled_rank-0.json.gz"
FAST = HTA_TRACES / "trace_compare" / "test" / "test.json.gz"
NO_MARKERS = HTA_TRACES / "critical_path" / "simple_add" / "benchmark_result_493459_1694039959_trace.json.gz"
KIND_COLOURS = {"rgb(238, 202, 59)", "rgb(245, 133, 24)", "rgb(84, 162, 75)", "rgb(228, 87, 86)",
                "rgb(157, 117, 93)", "rgb(114, 183, 178)", "rgb(76, 120, 168)", "rgb(186, 176, 172)"}  # fmt: skip


def _thousand_runs(db_path: Path) -> int:
    engine = create_engine(f"sqlite:///{db_path}")
    now = datetime.now(timezone.utc)
    with Session(engine) as session:
        team = session.query(Team).filter_by(name="default").one()
        project = Project(team_id=team.id, name="sweep")
        session.add(project)
        session.flush()
        session.add_all(
            Run(project_id=project.id, name=f"lr-{i:04d}", tags=[], created_at=now - timedelta(seconds=i),
                updated_at=now - timedelta(seconds=i), primary_kind=("input", "compute", "launch")[i % 3])
            for i in range(1000)
        )  # fmt: skip
        session.commit()
        pid = project.id
    engine.dispose()
    return pid


@pytest.mark.browser
@pytest.mark.slow
def test_dashboard_pages_in_chromium(tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    shots = Path(os.environ.get("STEPDOCTOR_SCREENSHOTS") or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    env = migrated_sqlite_env(tmp_path / "data")
    with serve_subprocess(env) as server:
        token = cli_token(env, "admin")
        with httpx.Client(base_url=server.url, timeout=60) as api:
            slow = upload(api, TWO_STEPS.read_bytes(), token=token, project="vision", run="slow").json()
            fast = upload(api, FAST.read_bytes(), token=token, project="vision", run="fast").json()
            plain = upload(
                api, NO_MARKERS.read_bytes(), token=token, project="vision", run="no-markers"
            ).json()
            assert analyse_queued(tmp_path / "data") >= 3
            diagnosis = api.get(
                f"/api/v1/runs/{slow['run_id']}", headers={"Authorization": f"Bearer {token}"}
            ).json()["diagnosis"]
        pid = _thousand_runs(tmp_path / "data" / "stepdoctor.sqlite3")
        outside: list[str] = []
        with playwright.sync_playwright() as pw:
            browser = launch_chromium(pw)
            page = browser.new_page(viewport={"width": 1280, "height": 900}, accept_downloads=True)
            page.on("request", lambda r: None if r.url.startswith(server.url) else outside.append(r.url))

            # Login.
            page.goto(f"{server.url}/runs/{slow['run_id']}")
            assert "/login" in page.url
            page.screenshot(path=str(shots / "login.png"))
            page.fill("input[name=token]", token)
            page.click("button[type=submit]")

            # Run: verdict and first recommendation agree with the API's aggregate; facts present.
            page.wait_for_selector("#plot-breakdown .main-svg", timeout=30_000)
            verdict = page.inner_text("#verdict")
            assert f"Bound by {diagnosis['primary']['kind']}" in verdict
            first = diagnosis["recommendations"][0]
            assert first["title"] in verdict and first["title"] in page.inner_text("#next-optimization")
            assert "GPU utilization" in page.inner_text("#device-summary")
            page.click("#kernels th:nth-child(2)")  # sort by calls
            assert page.get_attribute("#kernels th:nth-child(2)", "aria-sort") == "descending"
            page.screenshot(path=str(shots / "run.png"), full_page=True)

            # Warnings next to the verdict they weaken.
            page.goto(f"{server.url}/runs/{plain['run_id']}")
            assert "no ProfilerStep markers" in page.inner_text("#warnings")
            page.screenshot(path=str(shots / "run-warnings.png"), full_page=True)

            # Trace: one step drawn, idle stretches coloured by the kind they were charged to.
            page.goto(f"{server.url}/traces/{slow['id']}")
            page.wait_for_selector("#plot-step .main-svg", timeout=30_000)
            fills = page.eval_on_selector_all(
                "#plot-step .trace.bars path", "els => els.map(e => getComputedStyle(e).fill)"
            )
            assert len(fills) > 20
            assert len(set(fills) & KIND_COLOURS) >= 3, set(fills)
            legend = page.eval_on_selector("#plot-step .legend", "e => e.textContent")
            assert "launch" in legend or "sync" in legend or "other" in legend
            page.screenshot(path=str(shots / "trace.png"), full_page=True)

            # A trimmed download that parses and is smaller.
            page.fill("#trim-form input[name=steps]", "552")
            with page.expect_download() as info:
                page.click("#trim-form button")
            cut = tmp_path / info.value.suggested_filename
            info.value.save_as(str(cut))
            assert cut.stat().st_size < TWO_STEPS.stat().st_size
            assert [s.number for s in steps.find_steps(parse.load_trace(cut))] == [552]
            assert gzip.decompress(cut.read_bytes()).startswith(b'{"traceEvents"')

            # Compare: the slower run reads "slower" with a factor > 1.
            page.goto(f"{server.url}/compare?base={fast['run_id']}&other={slow['run_id']}")
            page.wait_for_selector("#plot-kinds .main-svg", timeout=30_000)
            factor = page.inner_text("#verdict .factor")
            number, word = factor.split("× ")
            assert word == "slower" and float(number) > 1.0
            page.screenshot(path=str(shots / "compare.png"), full_page=True)

            # A 1,000-run project, paged.
            page.goto(f"{server.url}/projects/{pid}")
            assert "Runs 1–50 of 1,000" in page.inner_text("#run-count")
            page.click("#pager a[rel=next]")
            assert "Runs 51–100 of 1,000" in page.inner_text("#run-count")
            assert page.locator("#runs tbody tr").count() == 50
            page.screenshot(path=str(shots / "project.png"), full_page=True)

            # A missing page is a page.
            page.goto(f"{server.url}/runs/987654")
            assert "Not found" in page.inner_text("h1")
            page.screenshot(path=str(shots / "missing.png"))
            browser.close()
        assert not outside, f"the dashboard fetched from outside the server: {outside}"
