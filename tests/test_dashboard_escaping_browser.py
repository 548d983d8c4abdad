"""Hostile names on every page that shows data, in Debian's Chromium: no script runs, nothing turns
into markup, and the text reads as it was written.

Two runs are uploaded with an upload-scope token, as any training job could: their event, kernel and
GPU names, tags, hostnames, command lines and batch sizes carry the payloads of ``support.hostile``.
Then each page is opened as the admin who would read them. A payload that ran would set
``window.__xss`` or open a dialog; one that became markup would leave an element with an event
handler, an ``<img>``, a ``javascript:`` link or an inline script in the DOM. The page's own scripts
must still run (plots drawn) with no Content-Security-Policy complaint: the nonce lets them in.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import pytest

from support.dashboard import analyse_queued, launch_chromium
from support.hostile import (
    DEVICE,
    IMG_ONERROR,
    KERNELS,
    LINE_SEPARATORS,
    OPS,
    PAYLOADS,
    SCRIPT_CLOSE,
    gzipped,
    hostile_metadata,
    hostile_trace,
)
from support.server import cli_token, migrated_sqlite_env, serve_subprocess, upload

OTHER_DEVICE = "other" + LINE_SEPARATORS
TAGS = [f"#t{i}{p}" for i, p in enumerate(PAYLOADS)]
# What markup a payload would have left behind, and whether the JSON data blocks still parse.
INSPECT = """() => {
  const injected = [];
  for (const el of document.querySelectorAll("*")) {
    for (const name of el.getAttributeNames()) {
      if (name.toLowerCase().startsWith("on")) injected.push(el.tagName + "[" + name + "]");
    }
    const tag = el.tagName.toLowerCase();
    if (tag === "img") injected.push("img " + el.getAttribute("src"));
    const href = (el.getAttribute("href") || el.getAttribute("xlink:href") || "").trim().toLowerCase();
    if (href.startsWith("javascript:")) injected.push(tag + " " + href);
    if (tag === "script" && !el.src && el.type !== "application/json") injected.push("inline script");
  }
  const broken = [];
  for (const block of document.querySelectorAll("script[type='application/json']")) {
    try { JSON.parse(block.textContent); } catch (e) { broken.push(String(e)); }
  }
  return {xss: window.__xss === undefined ? null : window.__xss, injected: injected, broken: broken,
          text: document.body.textContent};
}"""


# Hover the first box of ``plot`` whose customdata[0] is ``text`` with plotly's own hover (by curve and
# point, no mouse), after clearing any label; the labels plotly then draws. null when no box carries
# ``text`` or no label is drawn within 10 s (plotly defers a hover that comes within 50 ms of the last).
HOVER = """async ([plot, text]) => {
  const gd = document.getElementById(plot);
  let box = null;
  gd.data.forEach((trace, curve) => (trace.customdata || []).forEach((data, point) => {
    if (box === null && Array.isArray(data) && data[0] === text) box = [curve, point];
  }));
  if (box === null) return null;
  const drawn = () => Array.from(gd.querySelectorAll(".hoverlayer .hovertext"), (label) => label.textContent);
  Plotly.Fx.unhover(gd);  // removes the last label and any hover still deferred
  Plotly.Fx.hover(gd, [{curveNumber: box[0], pointNumber: box[1]}]);
  for (const end = Date.now() + 10000; Date.now() < end; await new Promise((r) => setTimeout(r, 20))) {
    if (drawn().length > 0) return drawn();
  }
  return null;
}"""


class Watch:
    """A page with everything that would show a payload at work recorded as it happens."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.dialogs: list[str] = []
        self.csp: list[str] = []
        self.errors: list[str] = []
        page.on("dialog", self._dialog)
        page.on("console", lambda m: self.csp.append(m.text) if "Content Security Policy" in m.text else None)
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))

    def _dialog(self, dialog: Any) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def visit(self, url: str, plots: tuple[str, ...] = ()) -> str:
        """Open ``url``, wait for its plots, check nothing ran or became markup; the page's text."""
        self.page.goto(url)
        self.check(url)
        for plot in plots:  # drawn: the page's own scripts ran under the nonce
            self.page.wait_for_selector(f"#{plot} .main-svg", timeout=30_000)
        return self.check(url)

    def check(self, where: str) -> str:
        seen = self.page.evaluate(INSPECT)
        assert seen["xss"] is None, (where, seen["xss"])
        assert seen["injected"] == [], (where, seen["injected"])
        assert seen["broken"] == [], (where, seen["broken"])
        assert self.dialogs == [], (where, self.dialogs)
        assert self.csp == [], (where, self.csp)
        assert self.errors == [], (where, self.errors)
        return str(seen["text"])


def _upload_runs(url: str, token: str, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    with httpx.Client(base_url=url, timeout=60) as api:
        a = upload(
            api,
            gzipped(hostile_trace(tmp_path / "a.json")),
            token=token,
            project="hostile",
            run="a",
            metadata=hostile_metadata(),
        )
        other = hostile_metadata(devices=OTHER_DEVICE, batch_size=IMG_ONERROR)
        b = upload(
            api,
            gzipped(hostile_trace(tmp_path / "b.json", device=OTHER_DEVICE)),
            token=token,
            project="hostile",
            run="b",
            metadata=other,
        )
    assert a.status_code == b.status_code == 201, (a.text, b.text)
    return a.json(), b.json()


@pytest.mark.browser
@pytest.mark.slow
def test_hostile_names_stay_text_on_every_page_in_chromium(tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    env = migrated_sqlite_env(tmp_path / "data")
    with serve_subprocess(env) as server:
        token = cli_token(env, "upload")  # what every training job holds
        admin = cli_token(env, "admin")
        a, b = _upload_runs(server.url, token, tmp_path)
        assert analyse_queued(tmp_path / "data") == 2
        with playwright.sync_playwright() as pw:
            browser = launch_chromium(pw)
            watch = Watch(browser.new_page(viewport={"width": 1280, "height": 900}))
            page, base = watch.page, server.url

            # Login: the ``next`` it carries back into the form stays a value.
            watch.visit(f"{base}/login?next=" + quote("/" + SCRIPT_CLOSE))
            assert page.input_value("input[name=next]") == "/" + SCRIPT_CLOSE
            page.fill("input[name=token]", admin)
            page.click("button[type=submit]")
            page.wait_for_load_state()
            assert "Not found" in watch.check("the 404 page ``next`` led to")

            # Lists: every tag as written.
            home = watch.visit(f"{base}/")
            assert all(tag in home for tag in TAGS), home
            project = page.get_attribute("#projects a", "href")
            assert all(tag in watch.visit(f"{base}{project}") for tag in TAGS)
            assert all(tag in watch.visit(f"{base}/runs") for tag in TAGS)
            watch.visit(f"{base}/runs?" + urlencode({"q": IMG_ONERROR, "tag": LINE_SEPARATORS}))
            assert page.input_value("input[name=q]") == IMG_ONERROR
            assert page.input_value("input[name=tag]") == LINE_SEPARATORS

            # Run: tags, the GPU's name, kernel and op tables.
            run = watch.visit(f"{base}/runs/{a['run_id']}", plots=("plot-breakdown",))
            assert all(tag in run for tag in TAGS)
            assert DEVICE in page.text_content("#device-summary")  # type: ignore[operator]
            _names_shown(page, "#kernels", KERNELS)
            _names_shown(page, "#operators", OPS)

            # Trace: the same, plus the drawn step's boxes named by the hostile events.
            watch.visit(f"{base}/traces/{a['id']}", plots=("plot-step", "plot-breakdown"))
            assert DEVICE in page.text_content("#device-summary")  # type: ignore[operator]
            _names_shown(page, "#kernels", KERNELS)
            _names_shown(page, "#operators", OPS)
            step = page.evaluate(
                "() => JSON.parse(document.querySelector(\"script[data-plot='plot-step']\").textContent)"
            )
            boxes = {
                c[0] for trace in step["data"] for c in trace.get("customdata") or [] if isinstance(c, list)
            }
            # In plotly's markup, escaped as plotly reads it back: the names as written.
            assert {escape(n, quote=False) for n in (*KERNELS, *OPS)} <= boxes, boxes
            for name, label in _hover_labels(page, "plot-step", (*KERNELS, *OPS)).items():
                assert label.startswith(name), (name, label)  # hover labels: the names as written
            watch.check("the step plot after hovering its boxes")

            # Compare: the sentences that quote both runs' GPUs and batch sizes.
            compare = watch.visit(f"{base}/compare?base={a['run_id']}&other={b['run_id']}", ("plot-compare",))
            assert f"devices: {DEVICE} vs {OTHER_DEVICE}." in compare, compare
            assert f"batch size: {SCRIPT_CLOSE} vs {IMG_ONERROR}." in compare, compare

            # Error pages that quote what was asked for.
            steps = "<img src=x onerror=alert(9)>"
            error = watch.visit(f"{base}/traces/{a['id']}/download?" + urlencode({"steps": steps}))
            assert repr(steps) in page.text_content("#error"), error  # type: ignore[operator]
            watch.visit(f"{base}/runs/987654" + quote(SCRIPT_CLOSE))
            # The session cookie; the "signed in" marker beside it holds only "1", no secret.
            cookies = [c["value"] for c in page.context.cookies() if c["name"] == "stepdoctor_session"]
            browser.close()
        # What the pages were asked with never reaches the server's log: tokens, session cookies.
        log = server.output()
        assert cookies and all(secret not in log for secret in (token, admin, *cookies))


def _names_shown(page: Any, table: str, names: tuple[str, ...]) -> None:
    """Each name is a table cell's title and text, character for character."""
    cells = page.eval_on_selector_all(
        f"{table} td.name", "els => els.map(e => [e.title, e.firstChild.textContent])"
    )
    for name in names:
        assert [name, name] in cells, (name, cells)


def _hover_labels(page: Any, plot: str, names: tuple[str, ...]) -> dict[str, str]:
    """Plotly draws hover labels through its own markup language: for each of ``names``, hover the
    box whose ``customdata`` carries it (as the figure's JSON holds it, escaped); the text of the
    label plotly drew for it, which starts with the name as written unless the name became markup.

    Plotly's own ``Fx.hover`` picks the box by curve and point. Moving the mouse over each box's
    centre instead read whatever label was up: plotly throttles hovers to one per 50 ms and draws a
    deferred one later, so the label read belonged to an earlier box, and which names were seen
    depended on the machine's speed.
    """
    labels: dict[str, str] = {}
    for name in names:
        drawn = page.evaluate(HOVER, [plot, escape(name, quote=False)])
        assert drawn is not None, (name, "no box carries it, or plotly drew no label within 10 s")
        assert len(drawn) == 1, (name, drawn)
        labels[name] = drawn[0]
    return labels
