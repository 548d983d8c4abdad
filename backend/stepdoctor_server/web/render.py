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

HERE = Path(stepdoctor_dashboard.__file__).parent  # the templates and static files
templates = Jinja2Templates(directory=str(HERE / "templates"))
formatting.register(templates.env)


def render(request: Request, name: str, viewer: Principal | None, **context: Any) -> HTMLResponse:
    """A page: its template with the viewer, the asset URLs and no auto-refresh unless asked."""
    return templates.TemplateResponse(
        request, name, {"viewer": viewer, "asset": assets.url, "refresh_s": None, **context}
    )
