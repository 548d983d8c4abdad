"""The API docs work without the internet: every byte of /docs and /redoc comes from the server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from stepdoctor_server.core.settings import Settings
from stepdoctor_server.web.app import create_app
from support.dashboard import launch_chromium
from support.server import migrated_sqlite_env, serve_subprocess


def test_docs_pages_reference_only_this_server(tmp_path: Path) -> None:
    # The pages touch no table: a bare app (no lifespan, no migrations) is enough.
    client = TestClient(create_app(Settings(data_dir=tmp_path, workers=0)))
    for page in ("/docs", "/redoc"):
        resp = client.get(page)
        assert resp.status_code == 200, page
        html = resp.text
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), f"{page} links off-site"
        for asset in re.findall(r"""(?:src|href)\s*=\s*["'](/docs-assets/[^"']+)""", html):
            got = client.get(asset)
            assert got.status_code == 200 and len(got.content) > 1000, asset
    assert "fonts.googleapis" not in client.get("/redoc").text
    bundle = client.get("/docs-assets/redoc.standalone.js")
    assert bundle.status_code == 200 and b"Redoc" in bundle.content
    assert b"cdn.redoc.ly" not in bundle.content
    assert client.get("/openapi.json").json()["paths"]


@pytest.mark.browser
@pytest.mark.slow
def test_docs_render_in_chromium_with_no_request_leaving_the_server(tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    if not Path("/usr/bin/chromium").exists():
        pytest.skip("Debian chromium not installed (make system-deps)")
    env = migrated_sqlite_env(tmp_path / "data")
    with serve_subprocess(env) as server:
        outside: list[str] = []
        with playwright.sync_playwright() as pw:
            browser = launch_chromium(pw)
            page = browser.new_page()
            # blob: URLs of the page's own origin (ReDoc's web worker) never touch the network.
            local = (server.url, f"blob:{server.url}/", "data:")
            page.on("request", lambda r: None if r.url.startswith(local) else outside.append(r.url))
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))

            page.goto(f"{server.url}/docs")
            page.wait_for_selector(".opblock", timeout=30_000)
            operations = page.locator(".opblock").count()
            paths = page.locator(".opblock-summary-path").all_inner_texts()
            assert operations >= 10, operations
            assert any("/api/v1/traces" in p for p in paths), paths
            page.locator(".opblock-summary").first.click()  # expanding an operation needs the JS too
            page.wait_for_selector(".opblock-body", timeout=10_000)

            page.goto(f"{server.url}/redoc")
            page.wait_for_selector("[data-section-id^='operation/']", timeout=30_000)
            assert page.locator("[data-section-id^='operation/']").count() >= 10
            browser.close()
        assert not errors, errors
        assert not outside, f"the API docs fetched from outside the server: {outside}"
