"""The dashboard in Debian's Chromium at a desktop (1400 px) and a phone (400 px) width: no page
scrolls sideways (wide tables scroll in their own box), every page starts with a working skip link,
bad addresses are HTML pages with a title and a language, and the parts of the run and trace pages
read as they should: stragglers marked on the rank chart, collectives by type, the memory plot's
capacity line, lanes named as threads, times with their zone, the compare breadcrumb, an expired
session explained, and ``?steps=5-6`` downloading steps 5 and 6.

Set ``STEPDOCTOR_SCREENSHOTS=DIR`` to keep the screenshots for review; otherwise they go to tmp.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, update

from stepdoctor_analysis import parsing as parse
from stepdoctor_analysis.model import steps
from stepdoctor_server.core.models import DashboardSession, utcnow
from support import synthetic
from support.dashboard import analyse_queued, launch_chromium
from support.dashboard_traces import back_to_back_cpu_steps, ddp_recorded_trace
from support.server import cli_token, migrated_sqlite_env, serve_subprocess, upload
from support.synthetic_dist import straggler_job

pytestmark = [pytest.mark.browser, pytest.mark.slow]
WIDTHS = [1400, 400]
RED = "rgb(228, 87, 86)"
BLUE = "rgb(76, 120, 168)"
LONG = "a-rather-long-project-name-for-the-vision-team"


@dataclass
class Site:
    url: str
    token: str
    data_dir: Path
    shots: Path
    ddp_run: int
    ddp_trace: int
    straggler_run: int
    memory_trace: int
    cpu_trace: int
    project: int


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    pytest.importorskip("playwright.sync_api")
    tmp = tmp_path_factory.mktemp("layout")
    shots = Path(os.environ.get("STEPDOCTOR_SCREENSHOTS") or tmp / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    env = migrated_sqlite_env(tmp / "data")
    job = straggler_job(tmp / "job", ranks=4, slow_rank=2, extra=0.5)
    with serve_subprocess(env) as server:
        token = cli_token(env, "admin")
        with httpx.Client(base_url=server.url, timeout=60) as api:

            def send(path: Path, run: str, rank: int = 0) -> dict[str, Any]:
                body = path.read_bytes()
                made: dict[str, Any] = upload(
                    api, body, token=token, project=LONG, run=run, rank=rank, gzipped=path.suffix == ".gz"
                ).json()
                return made

            ddp = [send(ddp_recorded_trace(tmp / f"ddp{r}.json", r), "ddp-all-reduce-with-recorded-sizes", r) for r in (0, 1)]  # fmt: skip
            straggler = [send(job / f"rank{r}.json", "ddp-with-a-straggling-rank-two", r) for r in range(4)]
            memory = synthetic.memory_trace(
                tmp / "mem.json", params=2 * 2**30, grads=2 * 2**30, state=4 * 2**30, activations=8 * 2**30
            )
            mem = send(memory, "memory-heavy-training")
            cpu = send(back_to_back_cpu_steps(tmp / "cpu.json.gz"), "cpu-steps")
            assert analyse_queued(tmp / "data") >= 8
            project = api.get(f"/api/v1/runs/{mem['run_id']}", headers={"Authorization": f"Bearer {token}"})
        yield Site(
            url=server.url,
            token=token,
            data_dir=tmp / "data",
            shots=shots,
            ddp_run=ddp[0]["run_id"],
            ddp_trace=ddp[0]["id"],
            straggler_run=straggler[0]["run_id"],
            memory_trace=mem["id"],
            cpu_trace=cpu["id"],
            project=project.json()["project_id"],
        )


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        browser = launch_chromium(pw)
        yield browser
        browser.close()


def _page(chromium: Any, site: Site, width: int, *, login: bool = True) -> Any:
    context = chromium.new_context(viewport={"width": width, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(60_000)
    if login:
        page.goto(f"{site.url}/login")
        page.fill("input[name=token]", site.token)
        page.click("form.inline button[type=submit]")
        page.wait_for_url(f"{site.url}/")
    return page


def _sideways(page: Any) -> dict[str, int]:
    """How far the page itself scrolls sideways, and the viewport it must fit."""
    return page.evaluate(
        "() => ({scroll: Math.max(document.documentElement.scrollWidth, document.body.scrollWidth),"
        " viewport: document.documentElement.clientWidth})"
    )


@pytest.mark.parametrize("width", WIDTHS)
def test_no_page_scrolls_sideways(chromium: Any, site: Site, width: int) -> None:
    page = _page(chromium, site, width)
    pages = {
        "home": "/",
        "runs": "/runs",
        "project": f"/projects/{site.project}",
        "run": f"/runs/{site.straggler_run}",
        "run-ddp": f"/runs/{site.ddp_run}",
        "trace": f"/traces/{site.ddp_trace}",
        "trace-memory": f"/traces/{site.memory_trace}",
        "compare": f"/compare?base={site.ddp_run}&other={site.straggler_run}",
        "guide": "/guide",
        "error": "/runs/abc",
    }
    wide = {}
    for name, path in pages.items():
        page.goto(site.url + path)
        page.wait_for_load_state("load")
        page.wait_for_timeout(300)  # plotly lays out responsive figures after load
        size = _sideways(page)
        page.screenshot(path=str(site.shots / f"{name}-{width}.png"), full_page=True)
        if size["scroll"] > size["viewport"]:
            wide[name] = size
    page.context.close()
    logged_out = _page(chromium, site, width, login=False)
    logged_out.goto(f"{site.url}/login")
    if (size := _sideways(logged_out))["scroll"] > size["viewport"]:
        wide["login"] = size
    logged_out.context.close()
    assert not wide, f"pages wider than the {width} px window: {wide}"


@pytest.mark.parametrize("width", WIDTHS)
def test_skip_link_and_error_pages(chromium: Any, site: Site, width: int) -> None:
    page = _page(chromium, site, width)
    for path in ("/", f"/runs/{site.ddp_run}", "/runs/abc"):
        page.goto(site.url + path)
        page.keyboard.press("Tab")
        focused = page.evaluate(
            "() => [document.activeElement.textContent, document.activeElement.className]"
        )
        assert focused == ["Skip to content", "skip-link"], path
        box = page.locator(".skip-link").bounding_box()
        assert box is not None and box["y"] >= 0 and box["x"] >= 0  # on screen while focused
        page.keyboard.press("Enter")
        assert page.url.endswith("#content")
        assert page.evaluate("() => document.activeElement.id") == "content"
    for path, words in (("/runs/abc", "run_id"), ("/compare?base=59", "other")):
        response = page.goto(site.url + path)
        assert response.status == 422 and response.headers["content-type"].startswith("text/html")
        assert page.evaluate("() => document.documentElement.lang") == "en"
        assert page.title().strip() and page.title() != "stepdoctor"
        assert page.inner_text("h1") == "Cannot do that"
        assert words in page.inner_text("#error")
    page.context.close()


@pytest.mark.parametrize("width", WIDTHS)
def test_run_and_trace_pages_show_their_parts(chromium: Any, site: Site, width: int) -> None:
    page = _page(chromium, site, width)
    # Rank chart: the straggler's bar in red, labelled, on the busy-time metric it was judged by.
    page.goto(f"{site.url}/runs/{site.straggler_run}")
    page.wait_for_selector("#plot-ranks .main-svg")
    fills = page.eval_on_selector_all(
        "#plot-ranks .trace.bars path", "els => els.map(e => getComputedStyle(e).fill)"
    )
    assert fills.count(RED) == 1 and fills.count(BLUE) == 3, fills
    assert "straggler" in page.eval_on_selector("#plot-ranks .annotation", "e => e.textContent")
    assert "busy time before collectives" in page.eval_on_selector(
        "#plot-ranks .ytitle", "e => e.textContent"
    )
    # Collectives by type on the run and trace pages, readable at this width.
    for path in (f"/runs/{site.ddp_run}", f"/traces/{site.ddp_trace}"):
        page.goto(site.url + path)
        table = page.locator("#collectives")
        assert table.is_visible()
        cells = table.locator("tbody tr").first.locator("td").all_inner_texts()
        assert cells[0].startswith("all_reduce") and cells[4] == "128 MiB" and cells[5].endswith("GB/s")
        table.locator("tbody tr").first.scroll_into_view_if_needed()
        assert _sideways(page)["scroll"] <= _sideways(page)["viewport"]
    # Lanes named as threads, and the memory plot's capacity line.
    page.goto(f"{site.url}/traces/{site.ddp_trace}")
    page.wait_for_selector("#plot-step .main-svg")
    ticks = page.eval_on_selector_all("#plot-step .ytick text", "els => els.map(e => e.textContent)")
    assert "main thread" in ticks and not [t for t in ticks if t.startswith("host thread")], ticks
    page.goto(f"{site.url}/traces/{site.memory_trace}")
    page.wait_for_selector("#plot-memory .main-svg")
    legend = page.eval_on_selector("#plot-memory .legend", "e => e.textContent")
    assert "cuda:0 capacity (80.0 GiB)" in legend
    dashed = page.eval_on_selector_all(
        "#plot-memory .scatterlayer path.js-line", "els => els.map(e => e.style.strokeDasharray)"
    )
    assert any(d for d in dashed), dashed
    # Times with their zone; the compare page's breadcrumb back to the project and the base run.
    page.goto(f"{site.url}/runs")
    times = page.locator("#runs time").all_inner_texts()
    assert times and all(t.endswith(" UTC") for t in times)
    page.goto(f"{site.url}/compare?base={site.ddp_run}&other={site.straggler_run}")
    crumb = page.locator("#breadcrumb")
    assert crumb.is_visible() and LONG in crumb.inner_text()
    crumb.locator(f"a[href='/projects/{site.project}']").click()
    assert page.url.endswith(f"/projects/{site.project}")
    page.context.close()


@pytest.mark.parametrize("width", WIDTHS)
def test_an_expired_session_says_so(chromium: Any, site: Site, width: int) -> None:
    page = _page(chromium, site, width)
    engine = create_engine(f"sqlite:///{site.data_dir / 'stepdoctor.sqlite3'}")
    with engine.begin() as conn:
        conn.execute(update(DashboardSession).values(expires_at=utcnow() - timedelta(minutes=1)))
    engine.dispose()
    page.goto(f"{site.url}/runs/{site.ddp_run}")
    assert "/login" in page.url
    assert "Your session expired" in page.inner_text("#login-notice")
    assert _sideways(page)["scroll"] <= _sideways(page)["viewport"]
    page.fill("input[name=token]", site.token)
    page.click("form.inline button[type=submit]")
    page.wait_for_url(f"{site.url}/runs/{site.ddp_run}")  # back where the user was going
    page.context.close()


def test_steps_5_6_download_steps_5_and_6(chromium: Any, site: Site, tmp_path: Path) -> None:
    page = _page(chromium, site, 1400)
    page.goto(f"{site.url}/traces/{site.cpu_trace}")
    page.fill("#trim-form input[name=steps]", "5-6")
    with page.expect_download() as info:
        page.click("#trim-form button")
    cut = tmp_path / info.value.suggested_filename
    info.value.save_as(str(cut))
    assert cut.name.endswith("_steps5-6.pt.trace.json.gz")
    assert [s.number for s in steps.find_steps(parse.load_trace(cut))] == [5, 6]
    page.context.close()
