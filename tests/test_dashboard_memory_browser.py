"""The stacked memory view in Debian's Chromium at a desktop width (1400 px): a real H100 loop's
trace (``tests/fixtures/traces/cuda/memory.json.gz``, 79.2 GiB device) uploaded and analysed by the
server, its trace page drawing allocated memory stacked by category, the capacity as a line, and the
peak's hover listing what was live then. Read from Plotly's own state (``gd.data``,
``gd.layout.shapes``) and from the SVG it drew."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from stepdoctor_analysis.report import contract
from support.dashboard import analyse_queued, launch_chromium
from support.server import cli_token, migrated_sqlite_env, serve_subprocess, upload

CUDA_MEMORY = Path(__file__).parent / "fixtures" / "traces" / "cuda" / "memory.json.gz"
GIB = 2**30
# Plotly's state and what it drew for the first stacked memory plot.
DRAWN = """() => {
  const gd = document.getElementById("plot-memory_use_0");
  const stacked = gd.data.filter(t => t.stackgroup);
  return {
    stacked: stacked.map(t => ({name: t.name, group: t.stackgroup, x: t.x, y: t.y})),
    peak: gd.data.findIndex(t => t.name === "peak"),
    shapes: (gd.layout.shapes || []).map(s => ({type: s.type, y0: s.y0, y1: s.y1, dash: s.line.dash})),
    yrange: gd._fullLayout.yaxis.range,
    fills: Array.from(gd.querySelectorAll(".scatterlayer .trace path.js-fill"))
      .filter(p => (p.getAttribute("d") || "").length > 10).length,
    lines: gd.querySelectorAll(".shapelayer path").length,
    notes: Array.from(gd.querySelectorAll(".annotation-text")).map(e => e.textContent),
  };
}"""


@pytest.mark.browser
@pytest.mark.slow
def test_stacked_memory_view_with_the_capacity_line_in_chromium(tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    env = migrated_sqlite_env(tmp_path / "data")
    with serve_subprocess(env) as server:
        token = cli_token(env, "admin")
        with httpx.Client(base_url=server.url, timeout=60) as api:
            made = upload(api, CUDA_MEMORY.read_bytes(), token=token, project="memory", run="h100").json()
            assert analyse_queued(tmp_path / "data") == 1
            report = api.get(
                f"/api/v1/traces/{made['id']}/report", headers={"Authorization": f"Bearer {token}"}
            )
        assert report.status_code == 200, report.text
        memory = contract.decode(report.json()["report"]).metrics.memory
        (peak,) = [p for p in memory.by_category if p.device == "cuda:0"]
        (capacity,) = [d["capacity"] for d in memory.devices if d["device"] == "cuda:0"]
        (series,) = [s for s in memory.series["categories"] if s["device"] == "cuda:0"]
        held = {c for c, b in peak.bytes.items() if b > 0}
        with playwright.sync_playwright() as pw:
            browser = launch_chromium(pw)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{server.url}/traces/{made['id']}")
            page.fill("input[name=token]", token)
            page.click("button[type=submit]")
            page.wait_for_selector("#plot-memory_use_0 .main-svg", timeout=30_000)
            drawn = page.evaluate(DRAWN)

            # Every category the report saw is one area of one stack, drawn.
            names = [t["name"] for t in drawn["stacked"]]
            assert set(names) == set(series["categories"]) | held and len(held) >= 3, names
            assert {t["group"] for t in drawn["stacked"]} == {"memory"}
            assert drawn["fills"] >= len(held)
            # Stacked at the peak's instant they add up to the report's peak.
            at = peak.at_us / 1000.0
            total = sum(t["y"][t["x"].index(at)] for t in drawn["stacked"])
            assert total == pytest.approx(peak.allocated / GIB)
            # The capacity: a dashed line at the device's 79.2 GiB, inside the drawn y range.
            (line,) = drawn["shapes"]
            assert line["type"] == "line" and line["dash"] == "dash"
            assert line["y0"] == line["y1"] == pytest.approx(capacity / GIB)
            assert drawn["lines"] == 1 and drawn["yrange"][1] >= capacity / GIB
            assert f"capacity {capacity / GIB:.1f} GiB" in drawn["notes"]
            assert any(f"mostly {peak.dominant}" in n for n in drawn["notes"]), drawn["notes"]

            # Hovering the peak lists what was live then: categories and the largest blocks' ops.
            page.evaluate(
                "i => Plotly.Fx.hover(document.getElementById('plot-memory_use_0'), [{curveNumber: i, pointNumber: 0}])",
                drawn["peak"],
            )
            hover = page.eval_on_selector(
                "#plot-memory_use_0 .hoverlayer",
                "e => Array.from(e.querySelectorAll('tspan.line')).map(t => t.textContent).join('\\n')",
            )
            assert f"{peak.dominant}: " in hover and "largest live blocks" in hover, hover
            assert str(peak.largest[0]["op"]) in hover, hover
            page.locator("#plot-memory_use_0").screenshot(path=str(tmp_path / "memory-stacked.png"))

            # 3.5% of the device is a thin band: "fit the stack" lets the categories fill the plot.
            page.click("#plot-memory_use_0 .updatemenu-button:has-text('fit the stack')")
            page.wait_for_function(
                "() => document.getElementById('plot-memory_use_0')._fullLayout.yaxis.range[1] < 10"
            )
            ymax = page.evaluate(
                "() => document.getElementById('plot-memory_use_0')._fullLayout.yaxis.range[1]"
            )
            assert peak.allocated / GIB < ymax < capacity / GIB / 2
            page.locator("#plot-memory_use_0").screenshot(path=str(tmp_path / "memory-stacked-fit.png"))
            browser.close()
