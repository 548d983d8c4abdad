"""The verdict guide as a dashboard page (``/guide#<kind>``), and the link every card carries to it.

The text is ``stepdoctor_analysis.report.guide``'s packaged copy of docs/verdicts.md, rendered with the
``markdown`` package (a server dependency); headings get ids (the ``toc`` extension), so
``/guide#transfer`` lands on the transfer section as ``docs/verdicts.md#transfer`` does on a
repository host. The page is public: it holds no team's data.
"""

from __future__ import annotations

from functools import cache

import markdown
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment

from stepdoctor_analysis.report import guide
from stepdoctor_server.web.render import render

PATH = "/guide"
router = APIRouter(include_in_schema=False)


def href(kind: str, rule_id: str | None = None) -> str:
    """The page and anchor explaining a verdict of ``kind`` (or the card ``rule_id``)."""
    return f"{PATH}#{guide.section_name(kind, rule_id)}"


@cache
def guide_html() -> str:
    """The guide as HTML: our own packaged text, not user input (guide.html marks it safe)."""
    return markdown.markdown(guide.text(), extensions=["fenced_code", "tables", "toc"])


def install(app: FastAPI, env: Environment) -> None:
    """Serve ``/guide`` and give the templates ``guide_href(kind, rule_id)``."""
    env.globals["guide_href"] = href
    app.include_router(router)


@router.get(PATH, response_class=HTMLResponse)
def guide_page(request: Request) -> HTMLResponse:
    return render(request, "guide.html", None, body=guide_html())
