"""``/docs`` (Swagger UI) and ``/redoc`` served from assets in the ``fastapi-offline`` wheel.

FastAPI's defaults load both from a CDN, so the API docs are blank on an air-gapped cluster and
every visit tells a third party who reads them. Here the pages, their scripts, styles and icon all
come from this server; ReDoc is told not to fetch Google Fonts and Swagger UI not to call its
online validator.

The pages are written here rather than by ``fastapi.openapi.docs``, whose Swagger page carries an
inline script with no nonce and pastes its settings in unescaped: here every ``<script>`` tag
carries the response's CSP nonce (``security.csp_nonce``), text is HTML-escaped, and the Swagger
settings go through ``stepdoctor_dashboard.escaping.script_json``, as the dashboard's data does.
"""

from __future__ import annotations

import functools
from html import escape
from importlib.resources import files

from fastapi import FastAPI, Request
from starlette.responses import HTMLResponse, Response
from starlette.staticfiles import StaticFiles

from stepdoctor_dashboard.escaping import script_json
from stepdoctor_server.web.security import csp_nonce

ASSETS_URL = "/docs-assets"
ASSETS_PACKAGE = ("fastapi_offline", "static")  # swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js
# ReDoc 2 hard-codes its sidebar logo's URL (no option turns it off): point it at our own icon.
REDOC_REMOTE_LOGO = b"https://cdn.redoc.ly/redoc/logo-mini.svg"


@functools.cache
def redoc_script() -> bytes:
    """The packaged ReDoc bundle with its one remote URL made local (read once per process)."""
    bundle = files(ASSETS_PACKAGE[0]).joinpath(ASSETS_PACKAGE[1], "redoc.standalone.js").read_bytes()
    return bundle.replace(REDOC_REMOTE_LOGO, f"{ASSETS_URL}/favicon.png".encode())


def install(app: FastAPI) -> None:
    """Mount the assets and the two pages; the app must be built with ``docs_url=redoc_url=None``."""

    @app.get(f"{ASSETS_URL}/redoc.standalone.js", include_in_schema=False)
    async def redoc_bundle() -> Response:  # before the mount, which would serve the unpatched file
        return Response(
            redoc_script(), media_type="application/javascript", headers={"Cache-Control": "max-age=3600"}
        )

    app.mount(ASSETS_URL, StaticFiles(packages=[ASSETS_PACKAGE]), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"
    title = f"{app.title} API"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        return HTMLResponse(swagger_ui_html(title, openapi_url, csp_nonce(request.scope)))

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        return HTMLResponse(redoc_html(title, openapi_url, csp_nonce(request.scope)))


# The settings FastAPI's own Swagger page uses, with the online validator off.
SWAGGER_SETTINGS = {
    "dom_id": "#swagger-ui",
    "layout": "BaseLayout",
    "deepLinking": True,
    "showExtensions": True,
    "showCommonExtensions": True,
    "validatorUrl": None,
}


def swagger_ui_html(title: str, openapi_url: str, nonce: str) -> str:
    """Swagger UI's page: its bundle and its start-up script, both under this response's nonce."""
    settings = script_json({**SWAGGER_SETTINGS, "url": openapi_url})
    body = f"""<div id="swagger-ui"></div>
<script nonce="{escape(nonce)}" src="{ASSETS_URL}/swagger-ui-bundle.js"></script>
<script nonce="{escape(nonce)}">
SwaggerUIBundle(Object.assign({settings}, {{
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset]
}}));
</script>"""
    return _page(title, f'<link rel="stylesheet" href="{ASSETS_URL}/swagger-ui.css">', body)


def redoc_html(title: str, openapi_url: str, nonce: str) -> str:
    """ReDoc's page: no Google Fonts, its bundle under this response's nonce."""
    body = f"""<noscript>ReDoc needs JavaScript to show the API documentation.</noscript>
<redoc spec-url="{escape(openapi_url)}"></redoc>
<script nonce="{escape(nonce)}" src="{ASSETS_URL}/redoc.standalone.js"></script>"""
    return _page(title, "<style>body { margin: 0; padding: 0; }</style>", body)


def _page(title: str, head: str, body: str) -> str:
    """A docs page with our icon around ``head`` and ``body`` (markup, already escaped)."""
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="{ASSETS_URL}/favicon.png">
<title>{escape(title)}</title>
{head}
</head>
<body>
{body}
</body>
</html>
"""
