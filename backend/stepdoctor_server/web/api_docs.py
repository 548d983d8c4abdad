"""``/docs`` (Swagger UI) and ``/redoc`` served from assets in the ``fastapi-offline`` wheel.

FastAPI's defaults load both from a CDN, so the API docs are blank on an air-gapped cluster and
every visit tells a third party who reads them. Here the pages, their scripts, styles and icon all
come from this server; ReDoc is told not to fetch Google Fonts and Swagger UI not to call its
online validator.
"""

from __future__ import annotations

import functools
from importlib.resources import files

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from starlette.responses import HTMLResponse, Response
from starlette.staticfiles import StaticFiles

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
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=title,
            swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_URL}/favicon.png",
            oauth2_redirect_url=None,
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=title,
            redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )
