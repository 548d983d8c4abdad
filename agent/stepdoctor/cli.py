"""The ``stepdoctor`` console script: a thin dispatcher to each layer's own command module.

Each subcommand lives with the layer it belongs to and is imported only when invoked, so the
agent-only install never imports the server's (absent) dependencies.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module with ``main(argv) -> int``, extra that provides its dependencies, summary)
COMMANDS: dict[str, tuple[str, str | None, str]] = {
    "analyze": ("stepdoctor_analysis.cli", "analyze", "diagnose trace files offline (no server)"),
    "trim": ("stepdoctor_analysis.trim_cli", "analyze", "cut steps out of a big trace (stepdoctor trim IN OUT --steps 5-6)"),
    "sync": ("stepdoctor.sync", None, "upload traces left in the local spool"),
    "serve": ("stepdoctor_server.cli", "server", "run the API server and dashboard"),
    "worker": ("stepdoctor_server.cli", "server", "run analysis workers only"),
    "token": ("stepdoctor_server.cli", "server", "create or list API tokens"),
    "db": ("stepdoctor_server.cli", "server", "database migrations (db upgrade)"),
}


def _usage() -> str:
    lines = ["usage: stepdoctor COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {summary}" for name, (_, _, summary) in COMMANDS.items()]
    lines += ["", "Run 'stepdoctor COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if args[0] == "--version":
        from stepdoctor import __version__

        print(__version__)
        return 0
    command = args[0]
    if command not in COMMANDS:
        print(f"stepdoctor: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, extra, _ = COMMANDS[command]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f" Install it with: pip install 'stepdoctor[{extra}]'" if extra else ""
        print(f"stepdoctor {command}: missing dependency ({exc.name or exc}).{hint}", file=sys.stderr)
        return 2
    # Server commands share one module and take the command name as their first argument.
    sub_argv = args if module_name == "stepdoctor_server.cli" else args[1:]
    return int(module.main(sub_argv) or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
