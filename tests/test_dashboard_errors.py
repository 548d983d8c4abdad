"""What a browser gets when a dashboard address is wrong or a session ended: an HTML page with a
title and a language (never the API's raw JSON), a login page that says the session expired, and
on every page a skip link to the content and, on the compare page, a breadcrumb back."""

from __future__ import annotations

import re
from datetime import timedelta
from html import unescape

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import update

from stepdoctor_server.auth import sessions
from stepdoctor_server.core.models import DashboardSession, utcnow
from support.server import drain, logged_in, synthetic_trace, upload

SKIP_LINK = '<a class="skip-link" href="#content">Skip to content</a>'


def _is_error_page(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"].startswith("text/html")
    html = r.text
    assert re.search(r'<html lang="en">', html)
    title = re.search(r"<title>(.*?)</title>", html, re.S)
    assert title and title.group(1).strip() != ""
    message = unescape(html.split('id="error"', 1)[1].split("</div>", 1)[0])
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    "path,words",
    [
        ("/runs/abc", ["run_id", "integer", "'abc'"]),
        ("/compare?base=59", ["other", "required"]),
        ("/compare?base=x&other=1", ["base", "integer"]),
        ("/traces/abc", ["trace_id", "integer"]),
        ("/projects/1x", ["project_id", "integer"]),
        ("/runs?page=0", ["page"]),
        ("/traces/abc/download", ["trace_id"]),
    ],
)
def test_invalid_page_addresses_render_the_error_page(
    app: FastAPI, read_token: str, path: str, words: list[str]
) -> None:
    with logged_in(app, read_token) as browser:
        _is_error_page(browser.get(path), 422, *words)


def test_page_errors_are_pages_and_api_errors_stay_json(
    client: TestClient, app: FastAPI, read_token: str
) -> None:
    with logged_in(app, read_token) as browser:
        _is_error_page(browser.get("/runs/abc?x=1"), 422, "run_id")
        _is_error_page(browser.get("/runs/987654"), 404, "run")
        _is_error_page(browser.get("/no/such/page"), 404, "No such page")
    for path in ("/api/v1/runs/abc", "/api/v1/runs/987654"):
        api = client.get(path)
        assert api.status_code in (404, 422) and api.headers["content-type"] == "application/json"
        assert "error" in api.json()


def test_an_expired_session_redirects_to_login_saying_so(app: FastAPI, read_token: str) -> None:
    with logged_in(app, read_token) as browser:
        assert browser.get("/runs").status_code == 200
        with app.state.db.session() as session:
            session.execute(update(DashboardSession).values(expires_at=utcnow() - timedelta(minutes=1)))
            session.commit()
        gone = browser.get("/runs?q=x", follow_redirects=False)
        assert gone.status_code == 303
        assert gone.headers["location"] == "/login?next=%2Fruns&reason=expired"
        login = browser.get(gone.headers["location"])
        assert 'id="login-notice"' in login.text and "Your session expired" in login.text
        assert 'name="next" value="/runs"' in login.text
        # Said once: the redirect cleared the dead cookies.
        assert browser.get("/runs", follow_redirects=False).headers["location"] == "/login?next=%2Fruns"
    with logged_in(app, read_token) as browser:  # the browser dropped the session cookie at its Max-Age
        browser.cookies.delete(sessions.COOKIE)
        gone = browser.get("/", follow_redirects=False)
        assert gone.headers["location"] == "/login?next=%2F&reason=expired"
    with logged_in(app, read_token) as browser:  # logging out is not expiring
        browser.get("/logout")
        assert browser.get("/runs", follow_redirects=False).headers["location"] == "/login?next=%2Fruns"
    with TestClient(app) as stranger:  # no cookie at all: the login page, with nothing to explain
        first = stranger.get("/runs", follow_redirects=False)
        assert first.headers["location"] == "/login?next=%2Fruns"
        assert "login-notice" not in stranger.get(first.headers["location"]).text


def test_every_page_has_a_skip_link_and_compare_a_breadcrumb(
    client: TestClient, app: FastAPI, read_token: str
) -> None:
    a = upload(client, synthetic_trace(), project="vision", run="base").json()
    b = upload(client, synthetic_trace(), project="vision", run="other").json()
    drain(app)
    project_id = client.get(f"/api/v1/runs/{a['run_id']}").json()["project_id"]
    with logged_in(app, read_token) as browser:
        compare = browser.get(f"/compare?base={a['run_id']}&other={b['run_id']}").text
        pages = {
            "/login": browser.get("/login").text,
            "/": browser.get("/").text,
            "/runs": browser.get("/runs").text,
            "project": browser.get(f"/projects/{project_id}").text,
            "run": browser.get(f"/runs/{a['run_id']}").text,
            "trace": browser.get(f"/traces/{a['id']}").text,
            "compare": compare,
            "error": browser.get("/runs/abc").text,
            "guide": browser.get("/guide").text,
        }
    for name, html in pages.items():
        body = html.split("<body>", 1)[1].lstrip()
        assert body.startswith(SKIP_LINK), name  # the first thing a keyboard reaches
        assert '<main id="content" tabindex="-1">' in html, name
    crumb = compare.split('id="breadcrumb"', 1)[1].split("</nav>", 1)[0]
    assert '<a href="/">Projects</a>' in crumb
    assert f'<a href="/projects/{project_id}">vision</a>' in crumb
    assert f'<a href="/runs/{a["run_id"]}">base</a>' in crumb
