"""One HTTP upload attempt, classified into delivered / retry / rejected (stdlib ``http.client``).

The request body streams from the spooled gzip file, so memory stays flat for multi-GB traces.
Clusters reach the outside through proxies and private CAs: the standard ``HTTPS_PROXY`` /
``HTTP_PROXY`` / ``NO_PROXY`` variables are honoured (HTTPS through a ``CONNECT`` tunnel, so the
proxy never sees the token or the trace), and a CA bundle comes from ``STEPDOCTOR_CA_BUNDLE``
(or ``REQUESTS_CA_BUNDLE`` / ``SSL_CERT_FILE``).

Every request has two bounds: a short connect timeout (a dead or firewalled host is known within
seconds, a refused connection at once) and, when the caller has one, a hard deadline. Socket
timeouts bound each read or write, not the request: a server that trickles bytes, or accepts and
never reads, would hold a request far past them. A watchdog timer shuts the socket down at the
deadline instead, which ends any blocked send or receive at once.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import functools
import http.client
import json
import os
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from stepdoctor.config import ca_bundle
from stepdoctor.version import __version__

METADATA_HEADER_MAX = 8 * 1024
RETRYABLE_4XX = {408, 429}
CONNECT_TIMEOUT = 5.0

Outcome = Literal["delivered", "retry", "rejected"]


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    status: int | None
    detail: str
    retry_after: float | None = None
    connected: bool = True  # False: no connection at all (refused, unreachable, DNS): the server is down
    body: str = ""  # the answer's first 4 KiB (a trace upload's answers with the trace's id)
    cut_short: bool = False  # the caller's own deadline ended the try: it says nothing about the server

    def created_id(self) -> int | None:
        """The ``id`` of a delivered upload's JSON answer (the server's trace id), or None."""
        try:
            found = json.loads(self.body).get("id") if self.outcome == "delivered" else None
        except (ValueError, AttributeError):
            return None
        return found if isinstance(found, int) and not isinstance(found, bool) else None


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP-date)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def metadata_header(metadata: dict[str, Any]) -> str:
    """Compact ASCII JSON within the protocol's 8 KiB; the bulkiest fields are trimmed first."""
    meta = dict(metadata)
    text = json.dumps(meta, separators=(",", ":"), ensure_ascii=True, default=str)
    if len(text) <= METADATA_HEADER_MAX:
        return text
    if isinstance(meta.get("argv"), list):
        meta["argv"] = [a[:200] for a in meta["argv"][:32]]
    text = json.dumps(meta, separators=(",", ":"), ensure_ascii=True, default=str)
    for key in ("tags", "devices", "argv", "env"):
        if len(text) <= METADATA_HEADER_MAX:
            break
        meta.pop(key, None)
        meta.setdefault("truncated", []).append(key)
        text = json.dumps(meta, separators=(",", ":"), ensure_ascii=True, default=str)
    return text[:METADATA_HEADER_MAX] if len(text) > METADATA_HEADER_MAX else text


def upload(
    server: str,
    token: str | None,
    trace: Path,
    sidecar: dict[str, Any],
    timeout: float,
    *,
    connect_timeout: float = CONNECT_TIMEOUT,
    deadline: float | None = None,
) -> Result:
    """POST one spooled trace; never raises for network or HTTP trouble, only classifies it.

    ``timeout`` bounds each socket operation, ``connect_timeout`` the connection (and TLS or proxy
    handshake), and ``deadline`` (``time.monotonic()``) the whole request.
    """
    url = urllib.parse.urlsplit(server)
    if url.scheme not in ("http", "https") or not url.hostname:
        return Result("rejected", None, f"invalid server URL {server!r}")
    query = {"project": sidecar["project"], "run": sidecar["run"]}
    if sidecar.get("rank") is not None:
        query["rank"] = str(sidecar["rank"])
    path = f"{url.path.rstrip('/')}/api/v1/traces?{urllib.parse.urlencode(query)}"
    metadata = dict(sidecar.get("metadata") or {})
    metadata["window"] = sidecar.get("window")
    headers = {
        "Content-Type": "application/json",
        "Content-Encoding": "gzip",
        "Content-Length": str(os.path.getsize(trace)),
        "Idempotency-Key": sidecar["idempotency_key"],
        "X-Stepdoctor-Metadata": metadata_header(metadata),
        "User-Agent": f"stepdoctor-agent/{__version__}",
    }
    return _post(url, path, headers, token, trace, timeout, connect_timeout, deadline)


SERIES_CONTENT_TYPE = "application/octet-stream"


def upload_series(
    server: str,
    token: str | None,
    chunk: Path,
    project: str,
    run: str,
    timeout: float,
    *,
    connect_timeout: float = CONNECT_TIMEOUT,
    deadline: float | None = None,
) -> Result:
    """POST one spooled step-series chunk (``stepdoctor.series``) to ``/api/v1/series``, classified
    like a trace upload; the server stores a chunk sent twice once, so no Idempotency-Key."""
    url = urllib.parse.urlsplit(server)
    if url.scheme not in ("http", "https") or not url.hostname:
        return Result("rejected", None, f"invalid server URL {server!r}")
    query = urllib.parse.urlencode({"project": project, "run": run})
    path = f"{url.path.rstrip('/')}/api/v1/series?{query}"
    headers = {
        "Content-Type": SERIES_CONTENT_TYPE,
        "Content-Length": str(os.path.getsize(chunk)),
        "User-Agent": f"stepdoctor-agent/{__version__}",
    }
    return _post(url, path, headers, token, chunk, timeout, connect_timeout, deadline)


def upload_snapshot(
    server: str,
    token: str | None,
    trace_id: int,
    snapshot: Path,
    timeout: float,
    *,
    connect_timeout: float = CONNECT_TIMEOUT,
    deadline: float | None = None,
) -> Result:
    """POST a window's CUDA memory snapshot (``stepdoctor.memory_snapshot``) to its trace, once the
    trace is delivered (``trace_id`` from its answer); classified like a trace upload. Sending the
    same bytes again is a replay, so no Idempotency-Key."""
    url = urllib.parse.urlsplit(server)
    if url.scheme not in ("http", "https") or not url.hostname:
        return Result("rejected", None, f"invalid server URL {server!r}")
    path = f"{url.path.rstrip('/')}/api/v1/traces/{trace_id}/memory-snapshot"
    headers = {
        "Content-Type": SERIES_CONTENT_TYPE,  # application/octet-stream, like the series chunks
        "Content-Length": str(os.path.getsize(snapshot)),
        "User-Agent": f"stepdoctor-agent/{__version__}",
    }
    return _post(url, path, headers, token, snapshot, timeout, connect_timeout, deadline)


def _post(
    url: urllib.parse.SplitResult,
    path: str,
    headers: dict[str, str],
    token: str | None,
    body_file: Path,
    timeout: float,
    connect_timeout: float,
    deadline: float | None,
) -> Result:
    """One POST of ``body_file`` (streamed) under the connect timeout, socket timeout and deadline."""
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            return Result("retry", None, "no time left to send", connected=False)
        timeout, connect_timeout = min(timeout, left), min(connect_timeout, left)
    try:
        conn, target, proxy_headers = connection(url, min(timeout, connect_timeout))
    except (OSError, ValueError) as exc:  # unreadable CA bundle, malformed proxy URL
        return Result("retry", None, _describe(exc), connected=False)
    headers.update(proxy_headers)
    watchdog = _Watchdog(conn, deadline)
    try:
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            detail = _describe(watchdog.explain(exc), "connecting")
            return Result("retry", None, detail, connected=False, cut_short=watchdog.fired)
        assert conn.sock is not None
        conn.sock.settimeout(timeout)
        try:
            with open(body_file, "rb") as body:
                conn.request("POST", target + path, body=body, headers=headers)
        except OSError as exc:
            # A server may answer (401, 413) and close before reading a large body: use its answer.
            early = None if watchdog.fired else _early_response(conn)
            if early is not None:
                return early
            return Result("retry", None, _describe(watchdog.explain(exc)), cut_short=watchdog.fired)
        response = conn.getresponse()
        text = response.read(4096).decode("utf-8", "replace")
        return classify(response.status, text, response.getheader("Retry-After"))
    except (OSError, http.client.HTTPException) as exc:
        detail = _describe(watchdog.explain(exc), "waiting for the answer")
        return Result("retry", None, detail, cut_short=watchdog.fired)
    finally:
        watchdog.cancel()
        conn.close()


class DeadlineExceeded(OSError):
    """The request was cut off at the caller's deadline."""


class _Watchdog:
    """Shuts ``conn``'s socket down at ``deadline``, so no blocked send or receive outlives it."""

    def __init__(self, conn: http.client.HTTPConnection, deadline: float | None) -> None:
        self.conn = conn
        self.fired = False
        self._timer: threading.Timer | None = None
        if deadline is not None:
            self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire)
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        sock = self.conn.sock
        if sock is not None:
            # The plain socket's shutdown: SSLSocket.shutdown would drop its SSL state under a
            # thread still reading it; this only ends the connection, and the reader sees EOF.
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def explain(self, exc: BaseException) -> BaseException:
        return DeadlineExceeded("no answer within the time limit") if self.fired else exc

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def proxy_for(url: urllib.parse.SplitResult) -> urllib.parse.SplitResult | None:
    """The proxy the environment names for this URL, or None (no proxy, or NO_PROXY matches)."""
    proxy = urllib.request.getproxies().get(url.scheme)
    if not proxy or urllib.request.proxy_bypass(url.netloc):
        return None
    parsed = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if parsed.scheme != "http" or not parsed.hostname:
        raise ValueError(f"unsupported proxy {proxy!r}: use http://HOST:PORT")
    return parsed


@functools.lru_cache(maxsize=4)
def _ssl_context(cafile: str | None, _mtime: float) -> ssl.SSLContext:
    if cafile and os.path.isdir(cafile):
        return ssl.create_default_context(capath=cafile)
    return ssl.create_default_context(cafile=cafile)


def ssl_context() -> ssl.SSLContext:
    """System CAs, or the configured bundle (reloaded when the file changes)."""
    cafile = ca_bundle()
    return _ssl_context(cafile, os.stat(cafile).st_mtime if cafile else 0.0)


def connection(
    url: urllib.parse.SplitResult, timeout: float
) -> tuple[http.client.HTTPConnection, str, dict[str, str]]:
    """(connection, request-target prefix, extra headers) for ``url``, through the proxy if one applies.

    HTTPS tunnels through the proxy with ``CONNECT`` and verifies the server's own certificate;
    plain HTTP sends the absolute URL to the proxy, as HTTP/1.1 proxies expect.
    """
    assert url.hostname is not None
    proxy = proxy_for(url)
    auth: dict[str, str] = {}
    if proxy is not None and proxy.username:
        userinfo = f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}"
        auth["Proxy-Authorization"] = "Basic " + base64.b64encode(userinfo.encode()).decode("ascii")
    if url.scheme == "https":
        context = ssl_context()
        if proxy is None:
            return (
                http.client.HTTPSConnection(
                    url.hostname, url.port, timeout=timeout, context=context, blocksize=1 << 16
                ),
                "",
                {},
            )
        tunnel = http.client.HTTPSConnection(
            proxy.hostname or "", proxy.port or 80, timeout=timeout, context=context, blocksize=1 << 16
        )
        tunnel.set_tunnel(url.hostname, url.port or 443, headers=auth)
        return tunnel, "", {}
    if proxy is None:
        return http.client.HTTPConnection(url.hostname, url.port, timeout=timeout, blocksize=1 << 16), "", {}
    conn = http.client.HTTPConnection(
        proxy.hostname or "", proxy.port or 80, timeout=timeout, blocksize=1 << 16
    )
    return conn, f"http://{url.netloc}", auth


def _early_response(conn: http.client.HTTPConnection) -> Result | None:
    if conn.sock is None:  # never connected: nothing to read
        return None
    try:
        response = conn.getresponse()
        text = response.read(4096).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):
        return None
    return classify(response.status, text, response.getheader("Retry-After"))


def _describe(exc: BaseException, doing: str = "") -> str:
    """``TimeoutError: timed out (connecting)``: the error, and the phase a bare timeout hit."""
    text = f"{type(exc).__name__}: {exc}".rstrip(": ")
    return f"{text} ({doing})" if doing and isinstance(exc, TimeoutError) else text


def classify(status: int, body: str, retry_after: str | None) -> Result:
    """2xx delivered; 408/429/5xx retried (honouring Retry-After); any other answer is final."""
    detail = f"HTTP {status}: {_one_line(body)}"
    if 200 <= status < 300:
        return Result("delivered", status, detail, body=body)
    if status in RETRYABLE_4XX or status >= 500:
        return Result("retry", status, detail, parse_retry_after(retry_after))
    return Result("rejected", status, detail)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]
