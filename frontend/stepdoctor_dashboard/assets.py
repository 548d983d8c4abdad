"""Static assets with versioned URLs: cached for a year by browsers, gzip-compressed once, offline.

plotly.min.js (4.8 MB; about 1.4 MB gzipped) comes from the installed ``plotly`` package, so the
dashboard never fetches from the internet. Each file's URL carries a version (plotly's own version,
or a hash of our file's content), so a response may be cached as ``immutable``: a new release has
a new URL. The gzip form is built on first request and kept in memory; clients that do not accept
gzip get the plain bytes.
"""

from __future__ import annotations

import gzip
import hashlib
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response

IMMUTABLE = "public, max-age=31536000, immutable"
_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}


@dataclass
class _Asset:
    path: Path
    version: str
    plain: bytes | None = None
    packed: bytes | None = None

    def load(self) -> tuple[bytes, bytes]:
        if self.plain is None or self.packed is None:
            self.plain = self.path.read_bytes()
            self.packed = gzip.compress(self.plain, compresslevel=9, mtime=0)
        return self.plain, self.packed


_ASSETS: dict[str, _Asset] = {}
_LOCK = threading.Lock()


def _plotly() -> tuple[Path, str]:
    import plotly

    return Path(str(resources.files("plotly") / "package_data" / "plotly.min.js")), str(plotly.__version__)


def register(static_dir: Path) -> None:
    """Index the files the pages link to: plotly.min.js and every file in ``static_dir``."""
    path, version = _plotly()
    _ASSETS["plotly.min.js"] = _Asset(path, version)
    for file in sorted(static_dir.iterdir()):
        if file.is_file() and file.suffix in _TYPES:
            digest = hashlib.sha256(file.read_bytes()).hexdigest()[:12]
            _ASSETS[file.name] = _Asset(file, digest)


def url(name: str) -> str:
    """The versioned URL of an asset, for templates: ``/static/v/<version>/<name>``."""
    asset = _ASSETS[name]
    return f"/static/v/{asset.version}/{name}"


def install(app: FastAPI, static_dir: Path) -> None:
    register(static_dir)

    @app.get("/static/v/{version}/{name}", include_in_schema=False)
    def versioned(version: str, name: str, request: Request) -> Response:
        asset = _ASSETS.get(name)
        if asset is None:
            return Response("not found", status_code=404, media_type="text/plain")
        with _LOCK:
            plain, packed = asset.load()
        # An old version's URL still gets the current bytes, but not the immutable promise.
        cache = IMMUTABLE if version == asset.version else "no-cache"
        headers = {"Cache-Control": cache, "Vary": "Accept-Encoding", "ETag": f'"{asset.version}"'}
        if request.headers.get("if-none-match") == headers["ETag"]:
            return Response(status_code=304, headers=headers)
        media = _TYPES.get(asset.path.suffix, "application/octet-stream")
        if "gzip" in request.headers.get("accept-encoding", ""):
            return Response(packed, media_type=media, headers={**headers, "Content-Encoding": "gzip"})
        return Response(plain, media_type=media, headers=headers)
