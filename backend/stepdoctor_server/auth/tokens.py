"""API tokens: generated once, stored as sha256, checked on every request.

A token carries one scope: ``upload`` (the agent; POST traces only), ``read`` (dashboards, scripts)
or ``admin`` (everything), and optionally an expiry; ``stepdoctor token revoke`` ends it at once.
The principal is resolved in its own short unit of work so a long upload never holds a database
transaction open while the body streams in.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Annotated

from fastapi import Depends, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from stepdoctor_server.core.database import Database, DatabaseDep
from stepdoctor_server.core.errors import ApiError
from stepdoctor_server.core.models import SCOPES, Team, Token, utcnow

TOKEN_PREFIX = "sdt_"
# last_used_at is informative; writing it on every request would serialise readers on SQLite.
log = logging.getLogger("stepdoctor.auth")
_TOUCH_INTERVAL = timedelta(seconds=60)


@dataclass(frozen=True)
class Principal:
    """Who is calling: a plain value, safe to use after the auth session closed."""

    team_id: int
    team_name: str
    token_id: int
    scope: str

    def allows(self, scope: str) -> bool:
        return self.scope == "admin" or self.scope == scope


def generate_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def get_or_create_team(session: Session, name: str) -> tuple[Team, bool]:
    """Return the team called ``name`` and whether it was created now."""
    team = session.scalar(select(Team).where(Team.name == name))
    if team is not None:
        return team, False
    team = Team(name=name)
    session.add(team)
    session.flush()
    return team, True


def create_token(
    session: Session, team: Team, *, scope: str, name: str, expires_at: datetime | None = None
) -> tuple[Token, str]:
    """Create a token; the plaintext is returned once and never stored."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    raw = generate_token()
    token = Token(
        team_id=team.id,
        name=name,
        scope=scope,
        hash=hash_token(raw),
        prefix=raw[: len(TOKEN_PREFIX) + 6],
        expires_at=expires_at,
    )
    session.add(token)
    session.flush()
    return token, raw


def list_tokens(session: Session, team: Team) -> list[Token]:
    return list(session.scalars(select(Token).where(Token.team_id == team.id).order_by(Token.id)))


def revoke_token(session: Session, team: Team, token_id: int) -> Token | None:
    """Mark the team's token ``token_id`` revoked (idempotent); None when the team has no such token.

    Every check reads ``revoked_at``, so API calls and dashboard sessions of the token stop at once.
    """
    token = session.scalar(select(Token).where(Token.team_id == team.id, Token.id == token_id))
    if token is not None and token.revoked_at is None:
        token.revoked_at = utcnow()
    return token


_DURATION = re.compile(r"([1-9][0-9]{0,5})([mhdw])")
_UNIT_SECONDS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``2w`` -> timedelta; ValueError with a one-line message otherwise."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"invalid duration {text!r}: use a number and a unit m, h, d or w (e.g. 30d)")
    return timedelta(seconds=int(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def token_state(token: Token, now: datetime | None = None) -> str:
    """``active``, ``revoked`` or ``expired``."""
    if token.revoked_at is not None:
        return "revoked"
    if token.expires_at is not None and _aware(token.expires_at) <= (now or utcnow()):
        return "expired"
    return "active"


def authenticate(session: Session, raw: str) -> Principal | None:
    """The principal for a plaintext token, or None when unknown or revoked."""
    row = session.execute(
        select(Token, Team.name).join(Team, Team.id == Token.team_id).where(Token.hash == hash_token(raw))
    ).first()
    if row is None:
        return None
    token, team_name = row
    now = utcnow()
    if token_state(token, now) != "active":
        return None
    last = token.last_used_at
    if last is None or now - _aware(last) > _TOUCH_INTERVAL:
        token.last_used_at = now  # at most one write a minute per token
    return Principal(team_id=token.team_id, team_name=team_name, token_id=token.id, scope=token.scope)


_bearer = HTTPBearer(auto_error=False, description="API token: `Authorization: Bearer sdt_...`")


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


def current_principal(
    db: DatabaseDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
) -> Principal:
    if credentials is None:
        raise _unauthorized("missing bearer token (send 'Authorization: Bearer <token>')")
    # A read: on SQLite it must not take (nor wait for) the write lock. The once-a-minute
    # last_used_at touch is written apart, in the background, and may be lost under contention.
    with db.session(read_only=True) as session:
        principal = authenticate(session, credentials.credentials)
        touched = {t.id: t.last_used_at for t in session.dirty if isinstance(t, Token)}
        session.rollback()
    if principal is None:
        raise _unauthorized("invalid, expired or revoked token")
    for token_id, when in touched.items():
        threading.Thread(target=_touch, args=(db, token_id, when), daemon=True).start()
    return principal


def _touch(db: Database, token_id: int, when: datetime | None) -> None:
    try:
        with db.session() as session:
            session.execute(update(Token).where(Token.id == token_id).values(last_used_at=when))
    except Exception as exc:  # informative only; a busy database can skip one
        log.debug("could not record the use of token %s: %s", token_id, exc)


CurrentTeam = Annotated[Principal, Depends(current_principal)]


def require_scope(scope: str) -> Callable[[Principal], Principal]:
    """A dependency that admits tokens with ``scope`` (or admin) and answers 403 otherwise."""

    def dependency(principal: CurrentTeam) -> Principal:
        if not principal.allows(scope):
            raise ApiError(
                403, "forbidden", f"this token has scope '{principal.scope}'; this endpoint needs '{scope}'"
            )
        return principal

    return dependency


ReadTeam = Annotated[Principal, Depends(require_scope("read"))]
UploadTeam = Annotated[Principal, Depends(require_scope("upload"))]
AdminTeam = Annotated[Principal, Depends(require_scope("admin"))]
