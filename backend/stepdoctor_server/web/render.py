"""The dashboard's templates (from ``stepdoctor_dashboard``) and the one function that renders a page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

import stepdoctor_dashboard
from stepdoctor_dashboard import assets, formatting
from stepdoctor_server.auth.tokens import Principal
from stepdoctor_server.web.security import csp_nonce

HERE = Path(stepdoctor_dashboard.__file__).parent  # the templates and static files
templates = Jinja2Templates(directory=str(HERE / "templates"))
formatting.register(templates.env)


def render(request: Request, name: str, viewer: Principal | None, **context: Any) -> HTMLResponse:
    """A page from its template; ``csp_nonce`` is for the template's own ``<script>`` tags only."""
    base = {"viewer": viewer, "asset": assets.url, "refresh_s": None, "csp_nonce": csp_nonce(request.scope)}
    return templates.TemplateResponse(request, name, {**base, **context})
