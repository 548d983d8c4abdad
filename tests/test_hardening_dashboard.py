"""Dashboard defences (#12): random-id sessions, same-origin checks, security headers."""

from __future__ import annotations

import hashlib
import re
from datetime import timedelta

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from stepdoctor_server.auth import sessions
from stepdoctor_server.core.models import DashboardSession
from stepdoctor_server.core.models import utcnow as now
from support.server import bearer, synthetic_trace, upload

SAME = {"Origin": "http://testserver"}


def _login(browser: TestClient, token: str, headers: dict[str, str] | None = None) -> object:
    return browser.post(
        "/login", data={"token": token, "next": "/"}, headers=headers or SAME, follow_redirects=False
    )


def test_session_cookie_is_a_random_id_stored_hashed(app: FastAPI, read_token: str) -> None:
    with TestClient(app) as browser:
        response = _login(browser, read_token)
        assert response.status_code == 303  # type: ignore[attr-defined]
        cookie = response.headers["set-cookie"]  # type: ignore[attr-defined]
        raw = browser.cookies.get(sessions.COOKIE)
        assert raw and read_token not in cookie and raw != read_token
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
        assert "Secure" not in cookie and "Max-Age=43200" in cookie
        with app.state.db.session() as session:
            stored = session.scalars(select(DashboardSession.hash)).all()
        assert stored == [hashlib.sha256(raw.encode()).hexdigest()]
        assert browser.get("/").status_code == 200


def test_cookie_is_secure_behind_https(app: FastAPI, read_token: str) -> None:
    with TestClient(app) as browser:
        headers = {"Origin": "https://testserver", "X-Forwarded-Proto": "https"}
        response = _login(browser, read_token, headers)
        assert response.status_code == 303  # type: ignore[attr-defined]
        assert "Secure" in response.headers["set-cookie"]  # type: ignore[attr-defined]
    with TestClient(app, base_url="https://testserver") as browser:
        response = _login(browser, read_token, {"Origin": "https://testserver"})
        assert "Secure" in response.headers["set-cookie"]  # type: ignore[attr-defined]


def test_expired_session_and_logout(app: FastAPI, read_token: str) -> None:
    with TestClient(app) as browser:
        _login(browser, read_token)
        raw = browser.cookies.get(sessions.COOKIE)
        with app.state.db.session() as session:
            session.execute(update(DashboardSession).values(expires_at=now() - timedelta(seconds=1)))
        assert browser.get("/", follow_redirects=False).status_code == 303

        _login(browser, read_token)
        raw = browser.cookies.get(sessions.COOKIE)
        assert browser.get("/").status_code == 200
        out = browser.post("/logout", headers=SAME, follow_redirects=False)
        assert out.status_code == 303 and sessions.COOKIE in out.headers["set-cookie"]
        with app.state.db.session() as session:
            assert session.scalars(select(DashboardSession)).all() == []
    with TestClient(app, cookies={sessions.COOKIE: raw or ""}) as replay:  # the old cookie is dead
        assert replay.get("/", follow_redirects=False).status_code == 303


def test_the_api_token_is_no_longer_a_cookie(app: FastAPI, read_token: str) -> None:
    with TestClient(app, cookies={"stepdoctor_token": read_token}) as browser:
        assert browser.get("/", follow_redirects=False).status_code == 303


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://testserver:9999"},  # another port is another origin (login CSRF)
        {"Origin": "http://evil.example"},
        {"Origin": "https://testserver"},  # another scheme
        {"Origin": "null"},
        {"Referer": "http://127.0.0.1:9999/attack.html"},
        {"Sec-Fetch-Site": "same-site"},  # no Origin nor Referer, but the browser says so
    ],
)
def test_cross_origin_posts_are_refused(
    app: FastAPI, read_token: str, admin_token: str, headers: dict[str, str]
) -> None:
    with TestClient(app) as browser:
        refused = _login(browser, read_token, headers)
        assert refused.status_code == 403  # type: ignore[attr-defined]
        assert refused.json()["error"]["code"] == "cross_origin"  # type: ignore[attr-defined]
        assert sessions.COOKIE not in browser.cookies
        with app.state.db.session() as session:
            assert session.scalars(select(DashboardSession)).all() == []

        _login(browser, admin_token)
        trace = upload(browser, synthetic_trace(5), token=admin_token).json()
        for path in (f"/traces/{trace['id']}/deep/critical-path", "/logout"):
            assert browser.post(path, headers=headers, follow_redirects=False).status_code == 403
        assert browser.get("/").status_code == 200  # still logged in: logout was refused


def test_same_origin_and_bearer_posts_pass(app: FastAPI, admin_token: str) -> None:
    with TestClient(app) as anyone:
        # An API client with a token may send any Origin: a browser never adds the header itself.
        response = upload(anyone, synthetic_trace(5), token=admin_token, headers={"Origin": "http://other"})
        assert response.status_code == 201
        # Same origin, also through a proxy that names the public host and scheme.
        assert _login(anyone, admin_token).status_code == 303  # type: ignore[attr-defined]
        proxied = {"Origin": "https://stepdoctor.example", "X-Forwarded-Proto": "https"}
        proxied["X-Forwarded-Host"] = "stepdoctor.example"
        assert _login(anyone, admin_token, proxied).status_code == 303  # type: ignore[attr-defined]


def _csp(response: object) -> dict[str, str]:
    header = response.headers["content-security-policy"]  # type: ignore[attr-defined]
    return {part.split()[0]: part for part in (p.strip() for p in header.split(";")) if part}


def test_security_headers_on_every_response(app: FastAPI, read_token: str) -> None:
    with TestClient(app) as browser:
        responses = [
            browser.get("/healthz"),
            browser.get("/api/v1/runs"),  # 401
            browser.get("/login"),
            browser.get("/no-such-page"),
            browser.get("/openapi.json"),
            browser.post("/login", data={"token": "x"}, headers={"Origin": "http://evil"}),  # 403
        ]
        _login(browser, read_token)
        responses += [browser.get("/"), browser.get("/api/v1/runs", headers=bearer(read_token))]
        css = re.search(rb'href="(/static/[^"]+\.css)"', responses[-2].content)
        if css:
            responses.append(browser.get(css.group(1).decode()))
        for response in responses:
            assert response.headers["x-frame-options"] == "DENY", response.url
            assert response.headers["x-content-type-options"] == "nosniff"
            policy = _csp(response)
            assert policy["frame-ancestors"] == "frame-ancestors 'none'"
            assert policy["default-src"] == "default-src 'self'"
            assert "unsafe-inline" not in policy["script-src"] and "http" not in policy["script-src"]


@pytest.mark.parametrize(
    "url",
    [
        "/runs?tag=a%00b",
        "/runs?q=a%00",
        "/projects/1?q=%00",
        "/api/v1/runs?tag=%00",
        "/api/v1/runs?project=%00",
        "/api/v1/traces/1/download?steps=%00",
        "/traces/%00",
    ],
)
def test_nul_in_any_url_is_400(app: FastAPI, read_token: str, admin_token: str, url: str) -> None:
    """PostgreSQL text cannot hold NUL: every URL carrying one is refused before any route runs."""
    with TestClient(app) as browser:
        upload(browser, synthetic_trace(5), token=admin_token)
        _login(browser, read_token)
        headers = bearer(read_token) if url.startswith("/api") else {}
        response = browser.get(url, headers=headers)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_request"
        assert response.headers["x-frame-options"] == "DENY"
        assert browser.get("/runs?tag=ok").status_code == 200


ODD_VALUES = ["", "0", "-1", str(2**31), str(2**63), str(2**64), "1e400", "nan", "x" * 300, "é", "../", "<b>"]


def _page_routes() -> list[tuple[str, list[str]]]:
    """(path with ids filled in, query parameter names) of every dashboard GET page."""
    from fastapi.routing import APIRoute

    from stepdoctor_server.web import pages as routes

    pages = []
    for route in routes.router.routes:
        if not isinstance(route, APIRoute) or "GET" not in (route.methods or ()) or route.path == "/logout":
            continue
        params = [p.alias for p in route.dependant.query_params]
        for dependency in route.dependant.dependencies:
            params += [p.alias for p in dependency.query_params]
        pages.append((re.sub(r"\{[a-z_]+\}", "1", route.path), params))
    return pages


def test_dashboard_pages_answer_odd_query_values_without_server_errors(
    app: FastAPI, read_token: str, admin_token: str
) -> None:
    """Every query parameter of every page, set to each odd value: never a 5xx."""
    pages = _page_routes()
    assert len(pages) >= 8
    with TestClient(app, raise_server_exceptions=False) as browser:
        upload(browser, synthetic_trace(5), token=admin_token)
        _login(browser, read_token)
        failures = []
        for path, params in pages:
            for name in params:
                for value in ODD_VALUES:
                    response = browser.get(path, params={name: value}, follow_redirects=False)
                    if response.status_code >= 500:
                        failures.append(f"{path}?{name}={value[:20]} -> {response.status_code}")
        assert not failures, failures
