"""The ``stepdoctor`` console script: a thin dispatcher to each layer's own command module.

Each subcommand lives with the layer it belongs to and is imported only when invoked, so the
agent-only install never imports the server's (absent) dependencies. One table says, for every
command, the function that runs it: ``main(argv)`` gets the arguments after the command's name. A command whose extra is
not installed answers with one line naming the ``pip install`` that fixes it (exit 2), whether
the gap shows before the command starts or when it first imports the missing module.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence
from typing import NamedTuple, NoReturn


class Command(NamedTuple):
    entry: str  # "module:function"; the function takes the argv after the command name
    extra: str | None  # the extra that installs its dependencies (None: stdlib only)
    summary: str
    # Ends the process without freeing its objects once the output is flushed (``finish``): an
    # analysis leaves millions of them, and freeing them took ~20 ms of a 0.34 s ``analyze``.
    exits_fast: bool = False


COMMANDS: dict[str, Command] = {
    "analyze": Command(
        "stepdoctor_analysis.cli.analyze:main",
        "analyze",
        "diagnose trace files offline (no server)",
        exits_fast=True,
    ),
    "trim": Command(
        "stepdoctor_analysis.cli.trim:main",
        "analyze",
        "cut steps out of a big trace (trim IN OUT --steps 5-6)",
    ),
    "check": Command(
        "stepdoctor_analysis.cli.check:main",
        "analyze",
        "CI gate: exit 1 when a run's step time regressed (check RUN --baseline RUN)",
    ),
    "sync": Command("stepdoctor.sync:main", None, "upload traces left in the local spool"),
    "serve": Command("stepdoctor_server.cli:serve_main", "server", "run the API server and dashboard"),
    "worker": Command("stepdoctor_server.job_handlers:main", "server", "run analysis workers only"),
    "token": Command("stepdoctor_server.cli:token_main", "server", "create, list or revoke API tokens"),
    "db": Command("stepdoctor_server.cli:db_main", "server", "database migrations (db upgrade)"),
    "mcp": Command(
        "stepdoctor_server.mcp_server:main", "mcp", "serve the diagnosis to coding agents over MCP (stdio)"
    ),
}

# extra -> top-level modules it installs that the commands need (a test keeps this in step with
# pyproject.toml). Checked with find_spec before the command runs: nothing is imported, so a
# missing module shows as a hint even when the command would only import it lazily, mid-run.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "analyze": ("numpy", "msgspec"),
    "server": (
        "numpy",
        "msgspec",
        "fastapi",
        "fastapi_offline",
        "uvicorn",
        "sqlalchemy",
        "alembic",
        "pydantic",
        "pydantic_settings",
        "plotly",
        "jinja2",
        "prometheus_client",
        "httpx",
    ),
    "hta": ("hta", "pandas"),
    "mcp": ("numpy", "msgspec", "mcp", "httpx"),
}


LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
INFO = 20  # logging.INFO: commands that log nothing (``analyze``) do not import logging (~9 ms)


def configure_logging(level: int = INFO, *, bare: bool = False) -> None:
    """The one place a command (never a library module) sets up logging: stderr, ``level``, and
    timestamped lines, or the message alone (``bare``) for commands a user reads in a terminal."""
    import logging

    logging.basicConfig(level=level, format="%(message)s" if bare else LOG_FORMAT)


def _usage() -> str:
    lines = ["usage: stepdoctor COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {command.summary}" for name, command in COMMANDS.items()]
    lines += ["", "Run 'stepdoctor COMMAND --help' for a command's options."]
    return "\n".join(lines)


def install_hint(command: str, extra: str, module: str) -> str:
    """The one line a user sees when ``command`` lacks ``module`` from ``extra``."""
    return (
        f"stepdoctor {command}: needs the '{extra}' extra ({module} is not installed): "
        f"pip install 'stepdoctor[{extra}]'"
    )


def missing_module(extra: str) -> str | None:
    """The first module of ``extra`` that cannot be imported, or None when all are there."""
    for name in EXTRA_MODULES.get(extra, ()):
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):  # a blocked or half-removed package
            return name
    return None


def extra_providing(module: str | None) -> str | None:
    """Which extra installs the top-level package of ``module`` (the narrowest one)."""
    top = (module or "").split(".")[0]
    for extra in ("analyze", "hta", "server"):
        if top in EXTRA_MODULES[extra]:
            return extra
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if args[0] == "--version":
        from stepdoctor.version import __version__

        print(__version__)
        return 0
    command = args[0]
    if command not in COMMANDS:
        print(f"stepdoctor: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    spec = COMMANDS[command]
    extra = spec.extra
    absent = missing_module(extra) if extra else None
    if extra and absent:
        print(install_hint(command, extra, absent), file=sys.stderr)
        return 2
    module_name, function = spec.entry.split(":")
    try:
        module = importlib.import_module(module_name)
        return int(getattr(module, function)(args[1:]) or 0)
    except ModuleNotFoundError as exc:
        # A module imported lazily deep inside the command (``--deep`` needs HTA, say).
        needed = extra_providing(exc.name) or extra
        if needed is None:
            raise
        print(install_hint(command, needed, exc.name or str(exc)), file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # a socket or a subprocess's pipe: a real error, not a reader that left
        return _reader_gone()


def entry() -> None:
    """The console script (and ``python -m stepdoctor``): ``main``, then the process's exit."""
    finish(main(), sys.argv[1] if len(sys.argv) > 1 else None)


def finish(rc: int, command: str | None) -> NoReturn:
    """End the process with ``rc`` after ``command`` ran, as the console script does.

    A command marked ``exits_fast`` skips the interpreter's teardown once its output is flushed,
    provided nothing else is running (no other thread, no multiprocessing child) whose atexit work
    that would skip. ``main`` itself always returns, so callers in a process of their own keep it.
    """
    spec = COMMANDS.get(command or "")
    if spec is not None and spec.exits_fast and _alone():
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed or broken stream: the ordinary exit reports it
            raise SystemExit(rc) from None
        import os

        os._exit(rc)
    raise SystemExit(rc)


def _alone() -> bool:
    """No thread but this one and no multiprocessing child left: nothing that atexit would wait for."""
    import threading

    if threading.active_count() > 1:
        return False
    mp = sys.modules.get("multiprocessing")
    return mp is None or not mp.active_children()


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or stdout is no file
        return False


def _reader_gone() -> int:
    """The output's reader closed it (``stepdoctor analyze ... | head``): stop quietly, as ``cat``
    does, with the status a shell gives a process SIGPIPE ended. Python would otherwise print a
    traceback, and another when it flushes stdout at exit, so stdout is pointed at /dev/null first."""
    import os

    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)
    return 141


if __name__ == "__main__":  # pragma: no cover
    entry()
