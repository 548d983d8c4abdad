"""Dashboard sessions: a random id in the cookie, its sha256 in ``dashboard_sessions``.

The API token typed at login never leaves the login request: the cookie carries a fresh
``secrets.token_urlsafe(32)`` that means nothing outside this server, expires after
``SESSION_TTL``, ends at logout, and ends with its token (revoked or expired). The cookie is
``HttpOnly``, ``SameSite=Strict`` and ``Secure`` whenever the request came over https (directly or
through a proxy that sets ``X-Forwarded-Proto``).
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta, timezone

from sqlalchemy import delete, select
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import Response

from stepdoctor_server.auth.tokens import Principal, token_state
from stepdoctor_server.core.models import DashboardSession, Team, Token, utcnow

COOKIE = "stepdoctor_session"
LEGACY_COOKIES = ("stepdoctor_token",)  # the old cookie held the raw API token: cleared at logout
SESSION_TTL = timedelta(hours=12)
# A second cookie, holding nothing but "1", outlives the session: the browser drops the session
# cookie when it expires, and this one tells the login page to say so rather than ask silently.
# Logout clears both, so a user who logged out is not told their session expired.
SIGNED_IN_COOKIE = "stepdoctor_signed_in"
SIGNED_IN_TTL = timedelta(days=30)


def _digest(raw: str) -> str:
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def start(session: Session, principal: Principal, *, ttl: timedelta = SESSION_TTL) -> str:
    """Record a new session for ``principal``'s token; returns the cookie value (shown once)."""
    now = utcnow()
    session.execute(delete(DashboardSession).where(DashboardSession.expires_at < now))  # housekeeping
    raw = secrets.token_urlsafe(32)
    session.add(DashboardSession(token_id=principal.token_id, hash=_digest(raw), expires_at=now + ttl))
    session.flush()
    return raw


def resolve(session: Session, raw: str | None) -> Principal | None:
    """The principal of a live session: unknown, expired, or with a dead token -> None."""
    principal, _ = lookup(session, raw)
    return principal


def lookup(
    session: Session, raw: str | None, *, signed_in: bool = False
) -> tuple[Principal | None, str | None]:
    """The principal of a live session, or why there is none: ``"expired"`` (the session outlived
    ``SESSION_TTL``, or the browser dropped its cookie while ``signed_in``: the
    ``SIGNED_IN_COOKIE`` is still there), ``"token"`` (its token was revoked or expired),
    ``"unknown"`` (no such session), ``None`` (never signed in, or logged out). The login page
    says which."""
    if not raw:
        return None, "expired" if signed_in else None
    if len(raw) > 128:
        return None, "unknown"
    row = session.execute(
        select(DashboardSession, Token, Team.name)
        .join(Token, Token.id == DashboardSession.token_id)
        .join(Team, Team.id == Token.team_id)
        .where(DashboardSession.hash == _digest(raw))
    ).first()
    if row is None:
        return None, "unknown"
    record, token, team_name = row
    now = utcnow()
    if _aware(record.expires_at) <= now:
        return None, "expired"
    if token_state(token, now) != "active":
        return None, "token"
    return Principal(team_id=token.team_id, team_name=team_name, token_id=token.id, scope=token.scope), None


def end(session: Session, raw: str | None) -> None:
    """Forget the session (logout); unknown ids are ignored."""
    if raw and len(raw) <= 128:
        session.execute(delete(DashboardSession).where(DashboardSession.hash == _digest(raw)))


def is_https(request: Request) -> bool:
    """Whether the browser talks https to us: the request scheme, or the proxy's X-Forwarded-Proto."""
    forwarded = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    return (forwarded or request.url.scheme) == "https"


def set_cookie(response: Response, request: Request, raw: str, *, ttl: timedelta = SESSION_TTL) -> None:
    response.set_cookie(
        COOKIE,
        raw,
        max_age=int(ttl.total_seconds()),
        httponly=True,
        samesite="strict",
        secure=is_https(request),
        path="/",
    )
    response.set_cookie(
        SIGNED_IN_COOKIE,
        "1",
        max_age=int(SIGNED_IN_TTL.total_seconds()),
        httponly=True,
        samesite="strict",
        secure=is_https(request),
        path="/",
    )


def clear_cookies(response: Response, request: Request) -> None:
    for name in (COOKIE, SIGNED_IN_COOKIE, *LEGACY_COOKIES):
        response.delete_cookie(name, path="/", httponly=True, samesite="strict", secure=is_https(request))
