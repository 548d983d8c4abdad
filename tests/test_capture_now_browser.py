"""The run page's "Capture now" in Debian's Chromium (Playwright), end to end: a user logs in, clicks
"Capture now" on a live run, sees the request pending (a second click says so), and once a real CPU
loop's agent has polled, captured and delivered the window, the page (which reloads itself while
the request is on its way) links the captured trace.

The run is made live by one step-series chunk sent the way the agent sends its series; the loop's
process starts with the server (importing torch meanwhile), its profile and poller only after the
clicks, so the pending state is seen whatever the machine's speed.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from support.capture import cpu_loop, make_live, mint_token, sqlite_env
from support.dashboard import launch_chromium
from support.fake_server import free_port
from support.server import bearer, serve_subprocess

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_capture_now_from_the_run_page_reaches_the_loop_and_links_its_trace(tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    env = sqlite_env(tmp_path / "server")
    agent_token, admin, reader = (mint_token(env, scope) for scope in ("upload", "admin", "read"))
    url = f"http://127.0.0.1:{free_port()}"
    with (
        cpu_loop(tmp_path, url, agent_token, "browser", poll_s=0.2, held=True) as loop,
        serve_subprocess(env, port=int(url.rsplit(":", 1)[1])) as server,
    ):
        with httpx.Client(base_url=server.url, timeout=60) as api:
            run_id = make_live(api, agent_token, "capture", "browser")
        with playwright.sync_playwright() as pw:
            browser = launch_chromium(pw)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.set_default_timeout(60_000)
                page.goto(f"{server.url}/login?next=/runs/{run_id}")
                page.fill("input[name=token]", admin)
                page.click("button[type=submit]")
                page.wait_for_url(f"**/runs/{run_id}")
                page.click("#capture-now")
                page.wait_for_url(f"**/runs/{run_id}#capture")
                state = page.locator("#capture-state")
                assert "Capture requested at" in state.inner_text()
                assert "UTC" in state.inner_text()  # the time says its zone
                page.click("#capture-now")  # a second click while it is pending
                page.wait_for_url(f"**/runs/{run_id}?capture=pending#capture")
                assert "A capture is already pending." in page.locator("#capture-state").inner_text()
                items = httpx.get(
                    f"{server.url}/api/v1/runs/{run_id}/capture-requests", headers=bearer(admin), timeout=60
                ).json()["items"]
                assert [i["status"] for i in items] == ["pending"]

                loop.go()
                page.goto(f"{server.url}/runs/{run_id}")
                link = page.locator("#capture-state a")  # the page reloads every 5 s meanwhile
                link.wait_for(state="attached", timeout=300_000)
                text = page.locator("#capture-state").inner_text()
                summary, _ = loop.stop()
                assert text.startswith("Captured: trace #"), text
                trace_id = int(text.removeprefix("Captured: trace #").split()[0])
                assert link.get_attribute("href") == f"/traces/{trace_id}"
                assert summary["captured"] == 1
                link.click()
                page.wait_for_url(f"**/traces/{trace_id}")

                # a reader sees the state, not the button
                other = browser.new_page()
                other.goto(f"{server.url}/login?next=/runs/{run_id}")
                other.fill("input[name=token]", reader)
                other.click("button[type=submit]")
                other.wait_for_url(f"**/runs/{run_id}")
                assert other.locator("#capture-now").count() == 0
                assert other.locator("#capture-state a").get_attribute("href") == f"/traces/{trace_id}"
            finally:
                browser.close()
