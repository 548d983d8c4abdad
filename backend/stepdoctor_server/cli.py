"""Server commands: ``serve``, ``worker``, ``token create|list|revoke``, ``db upgrade``.

``main(argv)`` takes the command name as ``argv[0]``; the ``stepdoctor`` dispatcher calls
``serve_main``/``token_main``/``db_main`` with the arguments after it (``stepdoctor worker`` is
``stepdoctor_server.jobs.pool.main``). Every error is one line on stderr and exit status 2, as for
usage errors (argparse's convention), never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from stepdoctor_server.auth import tokens as auth
from stepdoctor_server.core import migrate
from stepdoctor_server.core.database import Database
from stepdoctor_server.core.models import SCOPES, Team, utcnow
from stepdoctor_server.core.settings import Settings, get_settings
from stepdoctor_server.traces.storage import make_store

DEFAULT_TEAM = "default"


class CommandError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepdoctor", description="stepdoctor server commands")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", help="run the API server (applies migrations first)", description=_serve_doc()
    )
    serve.add_argument("--host", default=None, help="bind address (default STEPDOCTOR_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default STEPDOCTOR_PORT or 8000)")
    serve.add_argument(
        "--workers",
        type=int,
        default=None,
        help="analysis jobs at a time (default STEPDOCTOR_WORKERS); 0 = API only, safe to replicate",
    )
    serve.add_argument(
        "--migrate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply migrations before serving (default: yes, except with --workers 0, which only "
        "checks that `stepdoctor db upgrade` ran)",
    )

    token = commands.add_parser("token", help="create, list or revoke API tokens")
    token_commands = token.add_subparsers(dest="token_command", required=True)
    create = token_commands.add_parser("create", help="create a token (printed alone on the last line)")
    create.add_argument("--team", required=True, help="an existing team's name")
    create.add_argument(
        "--create-team",
        action="store_true",
        help="create the team when there is none of that name (without it a typo is refused)",
    )
    create.add_argument(
        "--scope", choices=SCOPES, default="upload", help="what the token may do (default upload)"
    )
    create.add_argument("--name", default=None, help="a label to recognise the token by")
    create.add_argument(
        "--expires-in",
        type=_duration,
        default=None,
        metavar="DURATION",
        help="expire after e.g. 90m, 12h, 30d or 2w",
    )
    listing = token_commands.add_parser("list", help="list a team's tokens (never the secrets)")
    listing.add_argument("--team", required=True)
    revoke = token_commands.add_parser("revoke", help="revoke a token now (API calls and dashboard sessions)")
    revoke.add_argument("token_id", type=int, metavar="ID", help="the token's ID (see token list)")
    revoke.add_argument("--team", required=True)

    db = commands.add_parser("db", help="database migrations")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    db_commands.add_parser("upgrade", help="apply the Alembic migrations up to the latest revision")
    return parser


def _duration(text: str) -> str:
    """argparse type: a usage error (exit 2, one line) for a malformed duration."""
    try:
        auth.parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _serve_doc() -> str:
    return (
        "Serve the API on one process. Configuration comes from STEPDOCTOR_* environment variables: "
        "DATA_DIR (SQLite file and trace store), DATABASE_URL (postgresql+psycopg://... for PostgreSQL), "
        "MAX_UPLOAD_BYTES, MAX_DECOMPRESSED_BYTES, WORKERS, HOST, PORT."
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        settings = get_settings()
        if args.command == "serve":
            return serve(
                settings, host=args.host, port=args.port, workers=args.workers, migrations=args.migrate
            )
        if args.command == "token":
            if args.token_command == "create":
                return token_create(
                    settings,
                    team=args.team,
                    scope=args.scope,
                    name=args.name,
                    expires_in=args.expires_in,
                    create_team=args.create_team,
                )
            if args.token_command == "revoke":
                return token_revoke(settings, team=args.team, token_id=args.token_id)
            return token_list(settings, team=args.team)
        if args.command == "db":
            return db_upgrade(settings)
    except CommandError as exc:
        print(f"stepdoctor {args.command}: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:  # a malformed STEPDOCTOR_* setting
        error = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        print(f"stepdoctor {args.command}: invalid setting {where}: {error['msg']}", file=sys.stderr)
        return 2
    except SQLAlchemyError as exc:
        orig = getattr(exc, "orig", None)
        detail = str(orig if orig is not None else exc).strip().splitlines()
        first = detail[0] if detail else type(exc).__name__
        print(
            f"stepdoctor {args.command}: database error at {settings.database_url_shown}: {first}"
            + _migration_hint(settings, args.command),
            file=sys.stderr,
        )
        return 2
    return 2


def _migration_hint(settings: Settings, command: str) -> str:
    """What to do when a command met a database without the schema (a fresh data dir, say)."""
    if command == "db":
        return ""
    try:
        current = migrate.is_current(settings)
    except SQLAlchemyError:  # unreachable: the error already says so
        return ""
    return "" if current else " (the database has no current schema: run `stepdoctor db upgrade` first)"


def serve_main(argv: Sequence[str]) -> int:
    """``stepdoctor serve ARGS``."""
    return main(["serve", *argv])


def token_main(argv: Sequence[str]) -> int:
    """``stepdoctor token create|list|revoke ARGS``."""
    return main(["token", *argv])


def db_main(argv: Sequence[str]) -> int:
    """``stepdoctor db upgrade``."""
    return main(["db", *argv])


def db_upgrade(settings: Settings) -> int:
    migrate.upgrade(settings)
    print(f"database at {settings.database_url_shown} is at revision {migrate.current_revision(settings)}")
    return 0


def token_create(
    settings: Settings,
    *,
    team: str,
    scope: str,
    name: str | None,
    expires_in: str | None = None,
    create_team: bool = False,
) -> int:
    _check_team_name(team)
    expires_at = None
    if expires_in is not None:
        try:
            expires_at = utcnow() + auth.parse_duration(expires_in)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
    db = Database(settings)
    try:
        with db.session() as session:
            if not create_team and session.scalar(select(Team.id).where(Team.name == team)) is None:
                raise CommandError(f"no team named {team!r}; add --create-team to create it")
            team_row, created = auth.get_or_create_team(session, team)
            token, raw = auth.create_token(
                session, team_row, scope=scope, name=name or f"{scope} token", expires_at=expires_at
            )
            token_id = token.id
    finally:
        db.dispose()
    if created:
        print(f"created team {team!r}")
    until = f", valid until {_when(expires_at)} UTC" if expires_at else ""
    print(f"created {scope} token #{token_id} for team {team!r}{until}; it is shown only once:")
    print(raw)
    return 0


@contextmanager
def _existing_team(settings: Settings, team: str) -> Iterator[tuple[Session, Team]]:
    """A unit of work on the team called ``team``; a one-line error when there is none."""
    db = Database(settings)
    try:
        with db.session() as session:
            team_row = session.scalar(select(Team).where(Team.name == team))
            if team_row is None:
                raise CommandError(f"no team named {team!r}")
            yield session, team_row
    finally:
        db.dispose()


def token_revoke(settings: Settings, *, team: str, token_id: int) -> int:
    with _existing_team(settings, team) as (session, team_row):
        token = auth.revoke_token(session, team_row, token_id)
        if token is None:
            raise CommandError(f"team {team!r} has no token #{token_id}")
        label = f"#{token.id} ({token.scope}, {token.prefix}…)"
    print(f"revoked token {label} of team {team!r}")
    return 0


def token_list(settings: Settings, *, team: str) -> int:
    with _existing_team(settings, team) as (session, team_row):
        tokens = auth.list_tokens(session, team_row)
    print(
        f"{'ID':>5}  {'SCOPE':<7} {'PREFIX':<12} {'NAME':<24} {'CREATED':<20} {'LAST USED':<20} "
        f"{'EXPIRES':<20} STATE"
    )
    for t in tokens:
        print(
            f"{t.id:>5}  {t.scope:<7} {t.prefix + '…':<12} {t.name[:24]:<24} {_when(t.created_at):<20} "
            f"{_when(t.last_used_at):<20} {_when(t.expires_at):<20} {auth.token_state(t)}"
        )
    return 0


def _when(value: object) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if hasattr(value, "strftime") else "-"


def _check_team_name(name: str) -> None:
    from stepdoctor_server.traces.ingest import NAME_RE

    if not NAME_RE.fullmatch(name):
        raise CommandError(f"invalid team name {name!r}: use 1-128 characters of [A-Za-z0-9._-]")


def bootstrap(settings: Settings, public_url: str) -> str | None:
    """On an empty database create team 'default' and an admin token; return the login text."""
    db = Database(settings)
    try:
        with db.session() as session:
            if (session.scalar(select(func.count(Team.id))) or 0) > 0:
                return None
            team, _ = auth.get_or_create_team(session, DEFAULT_TEAM)
            _, raw = auth.create_token(session, team, scope="admin", name="bootstrap admin")
    finally:
        db.dispose()
    return "\n".join(
        [
            "",
            f"First start: created team {DEFAULT_TEAM!r} and an admin token (shown only once, keep it):",
            f"    {raw}",
            f"Dashboard:   {public_url}/   (log in with the token above)",
            f"API docs:    {public_url}/docs",
            "Agent setup: export STEPDOCTOR_SERVER=" + public_url,
            "             export STEPDOCTOR_TOKEN=$(stepdoctor token create --team default --scope upload | tail -1)",
            "",
        ]
    )


def serve(
    settings: Settings,
    *,
    host: str | None,
    port: int | None,
    workers: int | None,
    migrations: bool | None = None,
) -> int:
    import uvicorn

    from stepdoctor_server.web.app import create_app

    updates: dict[str, object] = {}
    if host is not None:
        updates["host"] = host
    if port is not None:
        updates["port"] = port
    if workers is not None:
        if workers < 0:
            raise CommandError("--workers must be >= 0")
        updates["workers"] = workers
    settings = settings.model_copy(update=updates)
    # API replicas (--workers 0) never race to migrate; they refuse to serve an outdated schema.
    if migrations if migrations is not None else settings.workers > 0:
        migrate.upgrade(settings)
    elif not migrate.is_current(settings):
        raise CommandError(
            f"database at {settings.database_url_shown} is not at the latest schema revision: "
            "run `stepdoctor db upgrade` first (or serve --migrate)"
        )
    shown_host = "127.0.0.1" if settings.host in {"0.0.0.0", "::"} else settings.host
    message = bootstrap(settings, f"http://{shown_host}:{settings.port}")
    if message:
        print(message, flush=True)
    print(
        f"stepdoctor serve: database {settings.database_url_shown}, traces in {make_store(settings).description}, "
        f"{settings.workers} analysis worker(s)",
        flush=True,
    )
    from stepdoctor_server.web.timeouts import uvicorn_options

    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=False,
        **uvicorn_options(settings),  # header/body timeouts, a per-client connection cap, the grace
    )
    _serve_until_signalled(config, app)
    return 0


def _serve_until_signalled(config: Any, app: Any) -> None:
    """uvicorn's server, which also tells the analysis workers to stop the moment SIGTERM arrives:
    requests and jobs then share one grace period (``STEPDOCTOR_SHUTDOWN_GRACE_S``) instead of the
    workers' starting only once the last request ended."""
    import uvicorn

    from stepdoctor_server.web.app import begin_shutdown

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            begin_shutdown(app)
            super().handle_exit(sig, frame)

    GracefulServer(config).run()
