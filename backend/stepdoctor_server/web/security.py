"""Browser-facing defences for every response: a same-origin check on state-changing requests and
security headers (CSP, frame blocking, no MIME sniffing).

Both are pure ASGI middlewares (nothing buffered except HTML pages, which are small), registered
once in ``app.py`` so every route, present and future, gets them.

- **Origin check.** A ``POST``/``PUT``/``PATCH``/``DELETE`` that carries no ``Authorization`` header
  (so it could ride on the dashboard cookie, or log a victim in: login CSRF) must come from this
  origin: its ``Origin`` (else ``Referer``) must name the scheme and host the request was sent to
  (``X-Forwarded-Proto``/``X-Forwarded-Host`` when a proxy sets them). Another port is another
  origin. With neither header, ``Sec-Fetch-Site: cross-site|same-site`` is refused too; requests
  with none of them come from non-browser clients (browsers always send ``Origin`` on
  cross-origin POSTs) and pass; bearer-token calls pass (a browser never adds that
  header on its own, so they cannot be forged cross-site).
- **Headers.** ``Content-Security-Policy`` allows scripts, styles, images and fonts from this
  origin only (inline ``<script>`` blocks of each HTML page are allowed by their sha256, computed
  here, so templates need no nonces), ``frame-ancestors 'none'`` plus ``X-Frame-Options: DENY``,
  ``X-Content-Type-Options: nosniff`` and ``Referrer-Policy: same-origin``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
_DEFAULT_PORTS = {"http": "80", "https": "443"}
# Inline scripts only: <script> without src and with no type, or a JavaScript type. Data blocks
# (type="application/json") are not executed, so CSP does not apply to them.
_INLINE_SCRIPT = re.compile(rb"<script\b([^>]*)>(.*?)</script\s*>", re.IGNORECASE | re.DOTALL)
_SRC_ATTR = re.compile(rb"\ssrc\s*=", re.IGNORECASE)
_TYPE_ATTR = re.compile(rb"""\stype\s*=\s*["']?([^"'\s>]+)""", re.IGNORECASE)
_JS_TYPES = frozenset({b"text/javascript", b"application/javascript", b"module"})
_MAX_HASHED_HTML = 8 << 20  # larger HTML is sent as is, under the strict policy


def _policy(script_hashes: list[str]) -> str:
    scripts = " ".join(["'self'", *(f"'sha256-{h}'" for h in script_hashes)])
    return "; ".join(
        [
            "default-src 'self'",
            f"script-src {scripts}",
            # plotly.js and Swagger UI set inline style attributes and inject <style> elements.
            "style-src 'self' 'unsafe-inline'",
            "img-src 'self' data: blob:",
            "font-src 'self' data:",
            "connect-src 'self'",
            "worker-src 'self' blob:",
            "object-src 'none'",
            "base-uri 'self'",
            "form-action 'self'",
            "frame-ancestors 'none'",
        ]
    )


def inline_script_hashes(html: bytes) -> list[str]:
    """Base64 sha256 of every executable inline script in ``html`` (the CSP hash source form)."""
    hashes: list[str] = []
    for match in _INLINE_SCRIPT.finditer(html):
        attrs, body = match.group(1), match.group(2)
        if _SRC_ATTR.search(attrs):
            continue
        kind = _TYPE_ATTR.search(attrs)
        if kind is not None and kind.group(1).lower() not in _JS_TYPES:
            continue
        digest = base64.b64encode(hashlib.sha256(body).digest()).decode("ascii")
        if digest not in hashes:
            hashes.append(digest)
    return hashes


class SecurityHeadersMiddleware:
    """Adds the security headers to every HTTP response; HTML pages get their inline-script hashes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body: list[bytes] = []
        size = 0

        async def send_with_headers(message: Message) -> None:
            nonlocal start, size
            if message["type"] == "http.response.start":
                if not _is_html(message):
                    await send(_with_headers(message, []))
                    return
                start = message  # hold the headers until the page is known
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body.append(message.get("body", b""))
            size += len(body[-1])
            if message.get("more_body", False) and size <= _MAX_HASHED_HTML:
                return
            page = b"".join(body)
            hashes = inline_script_hashes(page) if size <= _MAX_HASHED_HTML else []
            held, start = start, None
            await send(_with_headers(held, hashes))
            await send({**message, "body": page})

        await self.app(scope, receive, send_with_headers)


def _is_html(message: Message) -> bool:
    for name, value in message.get("headers", ()):
        if name.lower() == b"content-type":
            return value.lower().startswith(b"text/html")
    return False


def _with_headers(message: Message, script_hashes: list[str]) -> Message:
    headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() not in _OWN_HEADERS]
    headers += [
        (b"content-security-policy", _policy(script_hashes).encode("ascii")),
        (b"x-frame-options", b"DENY"),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"same-origin"),
    ]
    return {**message, "headers": headers}


_OWN_HEADERS = frozenset(
    {b"content-security-policy", b"x-frame-options", b"x-content-type-options", b"referrer-policy"}
)


# -- same-origin check ---------------------------------------------------------------------------


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _normalise(scheme: str, netloc: str) -> str:
    scheme, netloc = scheme.lower(), netloc.lower()
    host, _, port = netloc.rpartition(":") if ":" in netloc and not netloc.endswith("]") else (netloc, "", "")
    if port and port == _DEFAULT_PORTS.get(scheme):
        netloc = host
    return f"{scheme}://{netloc}"


def request_origin(scope: Scope) -> str:
    """The origin the browser sent this request to (as a proxy forwarded it, when one did)."""
    forwarded_proto = (_header(scope, b"x-forwarded-proto") or "").split(",")[0].strip()
    forwarded_host = (_header(scope, b"x-forwarded-host") or "").split(",")[0].strip()
    scheme = forwarded_proto or str(scope.get("scheme", "http"))
    host = forwarded_host or _header(scope, b"host")
    if not host:
        server = scope.get("server") or ("localhost", None)
        host = f"{server[0]}:{server[1]}" if server[1] else str(server[0])
    return _normalise(scheme, host)


def _origin_of(url: str) -> str | None:
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        return None
    return _normalise(parts.scheme, parts.netloc)


def cross_origin_reason(scope: Scope) -> str | None:
    """Why this state-changing request must be refused, or None when it may proceed."""
    if scope["method"] in SAFE_METHODS or _header(scope, b"authorization") is not None:
        return None
    expected = request_origin(scope)
    origin = _header(scope, b"origin")
    if origin is not None:
        if origin.strip().lower() == "null" or _origin_of(origin.strip()) != expected:
            return f"cross-origin request refused: Origin {origin[:100]!r} is not {expected}"
        return None
    referer = _header(scope, b"referer")
    if referer is not None:
        if _origin_of(referer.strip()) != expected:
            return f"cross-origin request refused: Referer is not from {expected}"
        return None
    # Neither header (privacy settings may drop both): the browser's own Fetch Metadata, if sent.
    # "same-site" is another origin too (e.g. another port on this host).
    if (_header(scope, b"sec-fetch-site") or "").strip().lower() in ("cross-site", "same-site"):
        return "cross-origin request refused (Sec-Fetch-Site)"
    return None


def _refusal(status: int, code: str, message: str) -> tuple[Message, Message]:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }
    return start, {"type": "http.response.body", "body": body}


class NulGuardMiddleware:
    """400 for a NUL byte anywhere in the path or query: no route wants one, and PostgreSQL text
    cannot hold one (a ``?tag=%00`` filter would otherwise fail in the driver, a 500)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (
            "\x00" in scope.get("path", "") or b"%00" in scope.get("query_string", b"")
        ):
            for message in _refusal(400, "invalid_request", "NUL characters are not allowed in URLs"):
                await send(message)
            return
        await self.app(scope, receive, send)


class SameOriginMiddleware:
    """Refuses cross-origin state-changing requests that could ride on the dashboard cookie (403)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            reason = cross_origin_reason(scope)
            if reason is not None:
                for message in _refusal(403, "cross_origin", reason):
                    await send(message)
                return
        await self.app(scope, receive, send)
