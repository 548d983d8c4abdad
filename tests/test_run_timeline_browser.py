"""The run timeline in Debian's Chromium at 1400 px and 400 px: a run's step series uploaded to a
real ``stepdoctor serve``, its run page drawing step time over every step with the capture window
shaded and the slowdown marked, and stating the steady-state unprofiled median the API returns.
Read from Plotly's own state (``gd.data``) and from the SVG it drew."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from support.dashboard import launch_chromium
from support.series_chunks import chunk
from support.server import cli_token, migrated_sqlite_env, serve_subprocess

WINDOW = {"first_step": 2102, "last_step": 2104, "reason": "anomaly"}
DRAWN = """() => {
  const gd = document.getElementById("plot-timeline");
  const byName = name => gd.data.find(t => t.name === name) || null;
  const windows = byName("capture windows");
  const anomalies = byName("anomalies");
  const box = gd.getBoundingClientRect();
  return {
    names: gd.data.map(t => t.name),
    windowX: windows ? windows.x.filter(v => v !== null) : [],
    windowFill: windows ? windows.fill : null,
    anomalyX: anomalies ? anomalies.x : [],
    fills: Array.from(gd.querySelectorAll(".scatterlayer .trace path.js-fill"))
      .filter(p => (p.getAttribute("d") || "").length > 10).length,
    markers: gd.querySelectorAll(".scatterlayer .trace .points path").length,
    right: box.right,
    unprofiled: document.getElementById("timeline-unprofiled").textContent,
    liveness: document.getElementById("liveness").textContent,
    scrollWidth: document.documentElement.scrollWidth,
  };
}"""


def _chunks() -> list[bytes]:
    return [
        chunk("p1", 0, 0, 2000),
        chunk("p1", 1, 2000, 2000, profiled=[[2100, 2104]], windows=[WINDOW], slow={2050: 200.0}),
        chunk("p1", 2, 4000, 2000, final=True),
    ]


@pytest.mark.browser
@pytest.mark.slow
def test_the_run_timeline_draws_windows_anomalies_and_the_unprofiled_median(tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    env = migrated_sqlite_env(tmp_path / "data")
    with serve_subprocess(env) as server:
        token = cli_token(env, "admin")
        auth = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=server.url, timeout=60, headers=auth) as api:
            for data in _chunks():
                sent = api.post("/api/v1/series", params={"project": "p", "run": "long"}, content=data)
                assert sent.status_code == 201, sent.text
            run_id = sent.json()["run_id"]
            timeline: dict[str, Any] = api.get(f"/api/v1/runs/{run_id}").json()["run_timeline"]
        assert timeline["anomalies"] and timeline["windows"] == [WINDOW]
        with playwright.sync_playwright() as pw:
            browser = launch_chromium(pw)
            for width in (1400, 400):
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.goto(f"{server.url}/runs/{run_id}")
                if page.locator("input[name=token]").count():
                    page.fill("input[name=token]", token)
                    page.click("button[type=submit]")
                page.wait_for_selector("#plot-timeline .main-svg", timeout=30_000)
                drawn = page.evaluate(DRAWN)
                # the capture window: one shaded span over its steps
                assert drawn["windowFill"] == "toself" and drawn["fills"] >= 1, drawn
                assert (
                    min(drawn["windowX"])
                    < WINDOW["first_step"]
                    <= WINDOW["last_step"]
                    < max(drawn["windowX"])
                )
                # the slowdown: marked where the engine found it
                assert [a["first_step"] for a in timeline["anomalies"]] == drawn["anomalyX"] and drawn[
                    "markers"
                ]
                assert 2050 in drawn["anomalyX"]
                # the steady state in words, the API's number; the plot fits the page
                assert drawn["unprofiled"] == f"{timeline['unprofiled_median_ms']:.2f} ms"
                assert any(n.startswith("steady state, unprofiled") for n in drawn["names"])
                assert drawn["liveness"] == "finished"
                assert drawn["right"] <= width and drawn["scrollWidth"] <= width, (width, drawn)
                page.close()
            browser.close()
