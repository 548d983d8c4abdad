"""A 1,000-rank run page in Debian's Chromium: the heatmap draws, the straggler (rank 613) is marked
on it, the page holds no 1,000 rows or per-rank elements, a click on a rank opens that rank's trace,
and at 400 px nothing scrolls sideways. The run is written directly (``support.many_ranks``), then
served by ``stepdoctor serve``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient

from stepdoctor_server.auth import tokens as auth
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.web.app import create_app
from support.dashboard import launch_chromium
from support.many_ranks import many_rank_run
from support.server import bearer, migrated_sqlite_env, serve_subprocess

pytestmark = [pytest.mark.browser, pytest.mark.slow]
RED = "rgb(228, 87, 86)"


@dataclass
class Site:
    url: str
    token: str
    run_id: int
    trace_ids: dict[int, int]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    pytest.importorskip("playwright.sync_api")
    data = tmp_path_factory.mktemp("many-ranks") / "data"
    env = migrated_sqlite_env(data)
    app = create_app(Settings(data_dir=data, workers=0))
    try:
        with app.state.db.session() as session:
            team, _ = auth.get_or_create_team(session, "default")
            admin = auth.create_token(session, team, scope="admin", name="test")[1]
            reader = auth.create_token(session, team, scope="read", name="browser")[1]
        with TestClient(app, headers=bearer(admin)) as client:
            made = many_rank_run(app, client, 1000)
    finally:
        app.state.db.dispose()
    with serve_subprocess(env) as server:
        yield Site(url=server.url, token=reader, run_id=made.run_id, trace_ids=made.trace_ids)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        browser = launch_chromium(pw)
        yield browser
        browser.close()


def _run_page(chromium: Any, site: Site, width: int) -> Any:
    page = chromium.new_context(viewport={"width": width, "height": 900}).new_page()
    page.set_default_timeout(60_000)
    page.goto(f"{site.url}/login")
    page.fill("input[name=token]", site.token)
    page.click("form.inline button[type=submit]")
    page.wait_for_url(f"{site.url}/")
    page.goto(f"{site.url}/runs/{site.run_id}")
    page.wait_for_selector("#plot-ranks .heatmaplayer image")
    page.wait_for_selector("#plot-ranks .scatterlayer .point")
    return page


def test_the_heatmap_marks_the_straggler_without_a_row_per_rank(chromium: Any, site: Site) -> None:
    page = _run_page(chromium, site, 1400)
    marks = page.eval_on_selector_all(
        "#plot-ranks .scatterlayer .point", "els => els.map(e => getComputedStyle(e).fill)"
    )
    assert marks == [RED]
    assert "613: 1." in page.eval_on_selector("#plot-ranks .annotation", "e => e.textContent")
    assert page.inner_text("#stragglers").startswith(
        "1 straggler (by busy time before collectives): rank 613"
    )
    counts = page.evaluate(
        "() => ({rows: document.querySelectorAll('tr').length,"
        " images: document.querySelectorAll('#plot-ranks .heatmaplayer image').length,"
        " points: document.querySelectorAll('#plot-ranks .point').length,"
        " all: document.querySelectorAll('body *').length})"
    )
    assert counts["rows"] < 200 and counts["points"] < 200 and counts["images"] <= 3, counts
    assert counts["all"] < 2000, counts
    page.context.close()


def _click_rank(page: Any, column: int, row: int) -> int:
    """A mouse click on the heatmap's cell (rank column, metric row), where plotly drew it; returns
    the rank its hover label names (at 1,000 ranks a column is under a pixel wide: the neighbour
    may be the one under the mouse)."""
    page.locator("#plot-ranks").scroll_into_view_if_needed()
    x, y = page.evaluate(
        """([col, row]) => {
          const gd = document.getElementById('plot-ranks');
          const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
          const box = gd.querySelector('.nsewdrag').getBoundingClientRect();
          return [box.left + xa.l2p(col), box.top + ya.l2p(row)];
        }""",
        [column, row],
    )
    page.mouse.move(x, y)
    label = page.wait_for_selector("#plot-ranks .hovertext").text_content() or ""
    rank = int(label.split("rank ", 1)[1].split()[0])
    assert abs(rank - column) <= 1, label
    page.mouse.click(x, y)
    return rank


def test_a_click_on_a_rank_opens_its_trace(chromium: Any, site: Site) -> None:
    page = _run_page(chromium, site, 1400)
    # The straggler's marker, on the judged row, at rank 613's column (ranks are in order).
    page.locator("#plot-ranks").scroll_into_view_if_needed()
    box = page.locator("#plot-ranks .scatterlayer .point").bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    with page.expect_navigation():
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    assert page.url == f"{site.url}/traces/{site.trace_ids[613]}"
    assert "rank 613" in page.inner_text("h1")
    for column, row in ((42, 2), (900, 0)):  # a cell of the heatmap: that rank's trace
        page.goto(f"{site.url}/runs/{site.run_id}")
        page.wait_for_selector("#plot-ranks .heatmaplayer image")
        with page.expect_navigation():
            rank = _click_rank(page, column, row)
        assert page.url == f"{site.url}/traces/{site.trace_ids[rank]}"
    page.context.close()


def test_no_sideways_scroll_at_400_px(chromium: Any, site: Site) -> None:
    page = _run_page(chromium, site, 400)
    page.wait_for_timeout(300)  # plotly lays out responsive figures after load
    size = page.evaluate(
        "() => ({scroll: Math.max(document.documentElement.scrollWidth, document.body.scrollWidth),"
        " viewport: document.documentElement.clientWidth})"
    )
    assert size["scroll"] <= size["viewport"], size
    page.context.close()
