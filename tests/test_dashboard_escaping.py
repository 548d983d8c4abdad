"""Data in pages is data: the one escaper for ``<script>`` elements, templates that use only it, and a
Content-Security-Policy that runs the templates' own scripts and nothing a response body adds.

The browser half (every page, in Chromium, with hostile traces) is ``test_dashboard_escaping_browser``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from html import escape
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from stepdoctor_dashboard import escaping
from stepdoctor_server.web import security
from support.hostile import DEVICE, KERNELS, OPS, PAYLOADS, gzipped, hostile_metadata, hostile_trace
from support.server import drain, logged_in, upload

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = REPO / "frontend" / "stepdoctor_dashboard" / "templates"
# What could end a script element or a JavaScript string, or decode differently in an attribute.
SCRIPT_BREAKERS = set("<>&'\u2028\u2029")
# The only HTML a template may mark safe: our own packaged docs rendered to HTML, never data.
TRUSTED_HTML = {"guide.html": "{{ body | safe }}"}
MORE = ("<!--", "]]>", "&amp;", "'; alert(1); '", "\u2028", "</SCRIPT\t>", "<\\/script>")


class _Scripts(HTMLParser):
    """Every ``<script>`` element of a page as the HTML parser sees it: attributes and text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.scripts: list[tuple[dict[str, str], str]] = []
        self.tags: list[str] = []
        self.elements: list[tuple[str, dict[str, str]]] = []
        self._open: dict[str, str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.elements.append((tag, {k: v or "" for k, v in attrs}))
        if tag == "script":
            self._open = {k: v or "" for k, v in attrs}
            self.scripts.append((self._open, ""))

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._open = None


def _parse(html: str) -> _Scripts:
    parser = _Scripts()
    parser.feed(html)
    parser.close()
    return parser


def _script_src(response: Any) -> list[str]:
    """The ``script-src`` sources of a response's policy."""
    policy = response.headers["content-security-policy"]
    (directive,) = [p.split()[1:] for p in policy.split(";") if p.split()[:1] == ["script-src"]]
    return list(directive)


def _nonce(response: Any) -> str:
    (source,) = _script_src(response)
    match = re.fullmatch(r"'nonce-([A-Za-z0-9+/]+=*)'", source)
    assert match, source
    return match.group(1)


# -- the escaper -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [*PAYLOADS, *MORE])
def test_script_json_cannot_end_its_script_element(text: str) -> None:
    value = {"name": text, "names": [text, {"nested": text}], "n": 1.5}
    out = str(escaping.script_json(value))
    assert not SCRIPT_BREAKERS & set(out), out
    assert json.loads(out) == value  # JSON.parse reads every escape back: the text as written
    page = _parse(f'<script type="application/json">{out}</script><p>after</p>')
    assert page.scripts == [({"type": "application/json"}, out)]
    assert page.tags == ["script", "p"]


def test_script_json_is_markup_so_autoescape_leaves_it_alone() -> None:
    from jinja2 import Environment

    from stepdoctor_dashboard import formatting

    env = Environment(autoescape=True)
    formatting.register(env)
    html = env.from_string('<script type="application/json">{{ v | script_json }}</script>').render(
        v={"k": PAYLOADS[0]}
    )
    assert html == f'<script type="application/json">{escaping.script_json({"k": PAYLOADS[0]})}</script>'
    assert "&#34;" not in html and '"k"' in html  # quotes stay JSON quotes, not HTML entities


@pytest.mark.parametrize("value", [math.nan, math.inf, {"x": -math.inf}, {"x": object()}, {1j}])
def test_script_json_refuses_what_json_parse_cannot_read(value: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        escaping.script_json(value)


def test_plotly_text_shows_names_as_written_and_keeps_our_hover_markup() -> None:
    """plotly.js reads ``<a href>``, ``<b>``, ``<br>`` and entities in every text it draws."""
    from stepdoctor_dashboard import figures

    name = 'k<a href="javascript:x()">j</a> & <b>'
    step = {"number": 1, "why": "<i>", "lanes": [{"label": "host", "kind": "host", "boxes": [[0, 5, 0, 1]]}]}
    fig = figures.step_figure(step, [name])
    (trace,) = fig["data"]
    assert [c[:2] for c in trace["customdata"]] == [
        ['k&lt;a href="javascript:x()"&gt;j&lt;/a&gt; &amp; &lt;b&gt;', 1]
    ]
    assert "<br>" in trace["hovertemplate"]  # our own markup stays markup
    assert "&lt;i&gt;" in fig["layout"]["title"]["text"]
    assert figures.plotly_text({"name": "a<b", "hovertemplate": "<br>", "n": [1, "&"]}) == {
        "name": "a&lt;b",
        "hovertemplate": "<br>",
        "n": [1, "&amp;"],
    }


# -- the templates ---------------------------------------------------------------------------------


def test_templates_embed_data_only_through_script_json_and_nonce_their_scripts() -> None:
    """A new template or a new figure cannot bring back ``| safe`` or a script without the nonce."""
    templates = sorted(TEMPLATES.glob("*.html"))
    assert len(templates) >= 8
    for path in templates:
        text = path.read_text().replace(TRUSTED_HTML.get(path.name, "\0"), "")
        assert not re.search(r"\|\s*safe\b", text), f"{path.name} marks data safe"
        assert "tojson" not in text, f"{path.name}: use script_json (it escapes U+2028/2029 too)"
        for attrs, body in re.findall(r"<script\b([^>]*)>(.*?)</script>", text, re.DOTALL):
            if 'type="application/json"' in attrs:
                assert re.fullmatch(r"\{\{ [\w\[\]. ]+ \| script_json \}\}", body), (path.name, body)
            else:
                assert 'nonce="{{ csp_nonce }}"' in attrs, (path.name, attrs)
    dashboard = REPO / "frontend" / "stepdoctor_dashboard"
    for module in dashboard.glob("*.py"):
        if module.name == "escaping.py":  # the one escaper (``script_json``), tested above
            continue
        assert "Markup(" not in module.read_text(), f"{module.name} builds markup by hand"


# -- the policy ------------------------------------------------------------------------------------

INJECTED = "window.__xss=1"


def _echo_app() -> Starlette:
    """A page whose body carries an inline script the template did not write (data let through)."""

    async def page(request: Request) -> HTMLResponse:
        nonce = getattr(security, "csp_nonce", lambda scope: "")(request.scope)
        return HTMLResponse(
            f'<html><body><script nonce="{nonce}" src="/app.js"></script>'
            f"<p>name: <script>{INJECTED}</script></p></body></html>"
        )

    return Starlette(routes=[Route("/", page)], middleware=[])


def test_inline_scripts_in_the_body_are_not_allowed_by_the_policy() -> None:
    """The policy comes from the response, never from its body: an injected script is not hashed in."""
    with TestClient(security.SecurityHeadersMiddleware(_echo_app())) as client:
        response = client.get("/")
    sources = _script_src(response)
    digest = base64.b64encode(hashlib.sha256(INJECTED.encode()).digest()).decode()
    assert f"'sha256-{digest}'" not in sources
    assert not any("sha256" in s or "unsafe" in s or s in ("*", "'self'", "data:") for s in sources), sources
    assert len(sources) == 1 and sources[0].startswith("'nonce-"), sources


def test_each_response_gets_its_own_nonce_and_the_page_carries_it() -> None:
    seen: list[str] = []
    with TestClient(security.SecurityHeadersMiddleware(_echo_app())) as client:
        for _ in range(3):
            response = client.get("/")
            nonce = _nonce(response)
            assert len(base64.b64decode(nonce)) >= 16
            own = [a for a, _ in _parse(response.text).scripts if a.get("src")]
            assert own == [{"nonce": nonce, "src": "/app.js"}]
            seen.append(nonce)
    assert len(set(seen)) == 3, seen


def _check_page(response: Any) -> _Scripts:
    """Every script of a page is the template's own (its src under this response's nonce) or a JSON
    data block that parses; the payloads' markup never appears as markup."""
    assert response.headers["content-type"].startswith("text/html")
    page = _parse(response.text)
    for payload in PAYLOADS:
        assert "<script" not in payload or payload not in response.text
    assert "img" not in page.tags
    for attrs, body in page.scripts:
        if attrs.get("type") == "application/json":
            json.loads(body)
    nonce = _nonce(response)
    for attrs, _ in page.scripts:
        if attrs.get("type") != "application/json":
            assert attrs.get("nonce") == nonce, attrs
    return page


def _input_value(page: _Scripts, name: str) -> str:
    (value,) = [a.get("value") for tag, a in page.elements if tag == "input" and a.get("name") == name]
    return str(value)


def test_dashboard_pages_with_hostile_names_are_escaped_and_nonced(
    app: FastAPI, admin_token: str, tmp_path: Path
) -> None:
    with TestClient(app) as api:
        base = hostile_trace(tmp_path / "a.json")
        created = upload(api, gzipped(base), token=admin_token, run="a", metadata=hostile_metadata()).json()
        other = hostile_trace(tmp_path / "b.json", device="other" + PAYLOADS[3])
        meta = hostile_metadata(devices="other" + PAYLOADS[3], batch_size=PAYLOADS[1])
        second = upload(api, gzipped(other), token=admin_token, run="b", metadata=meta).json()
    assert drain(app) == 2
    with logged_in(app, admin_token) as browser:
        trace = browser.get(f"/traces/{created['id']}")
        scripts = _check_page(trace).scripts
        plots = {a["data-plot"]: json.loads(b) for a, b in scripts if a.get("type") == "application/json"}
        boxes = {
            c[0]
            for trace in plots["plot-step"]["data"]
            for c in trace.get("customdata") or []
            if isinstance(c, list)
        }
        # JSON.parse reads the names back as plotly's markup for the text as written.
        assert {escape(n, quote=False) for n in (*KERNELS, *OPS)} <= boxes, boxes
        assert DEVICE in _text(trace.text)
        run = browser.get(f"/runs/{created['run_id']}")
        _check_page(run)
        assert all(f"#t{i}{p}" in _text(run.text) for i, p in enumerate(PAYLOADS))
        compare = browser.get(f"/compare?base={created['run_id']}&other={second['run_id']}")
        _check_page(compare)
        assert f"{PAYLOADS[0]} vs {PAYLOADS[1]}" in _text(compare.text)
        home = browser.get("/")
        _check_page(home)
        project = re.search(r'href="(/projects/\d+)"', home.text)
        assert project, "the home page links the project"
        for page in (home, browser.get(project.group(1)), browser.get("/runs")):
            _check_page(page)
            assert all(f"#t{i}{p}" in _text(page.text) for i, p in enumerate(PAYLOADS))
        search = browser.get("/runs", params={"q": PAYLOADS[0], "tag": PAYLOADS[3]})
        assert _input_value(_check_page(search), "q") == PAYLOADS[0]
        assert _input_value(_check_page(search), "tag") == PAYLOADS[3]
        steps = "<img src=x onerror=alert(9)>"
        error = browser.get(f"/traces/{created['id']}/download", params={"steps": steps})
        assert error.status_code == 422
        _check_page(error)
        assert repr(steps) in _text(error.text)
    with TestClient(app) as anonymous:
        login = anonymous.get("/login", params={"next": "/" + PAYLOADS[0]})
        assert _input_value(_check_page(login), "next") == "/" + PAYLOADS[0]


def _text(html: str) -> str:
    """The page's text as a browser shows it (tags dropped, entities decoded)."""

    class Text(HTMLParser):
        def __init__(self) -> None:
            super().__init__(convert_charrefs=True)
            self.parts: list[str] = []

        def handle_data(self, data: str) -> None:
            self.parts.append(data)

    parser = Text()
    parser.feed(html)
    return "".join(parser.parts)


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_api_docs_scripts_carry_the_responses_nonce(app: FastAPI, path: str) -> None:
    with TestClient(app) as client:
        response = client.get(path)
    scripts = _check_page(response).scripts
    assert scripts and all(a.get("nonce") == _nonce(response) for a, _ in scripts)
    if path == "/docs":
        (inline,) = [body for a, body in scripts if not a.get("src")]
        settings = re.search(r"Object\.assign\((\{.*?\}), \{", inline, re.DOTALL)
        assert settings and json.loads(settings.group(1))["url"] == "/openapi.json"
