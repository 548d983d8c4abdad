"""The distribution's shape: the agent installs alone, extras split as documented (what the wheel
holds, and the image that installs it: test_wheel_install.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def _requirements() -> list[Requirement]:
    return [Requirement(r) for r in requires("stepdoctor") or []]


def _extra_of(req: Requirement) -> str | None:
    if req.marker is None:
        return None
    for extra in (
        "analyze",
        "server",
        "hta",
        "lightning",
        "transformers",
        "accelerate",
        "mcp",
        "trackers",
        "dev",
    ):
        if req.marker.evaluate({"extra": extra}) and not req.marker.evaluate({"extra": "__none__"}):
            return extra
    return "?"


def test_plain_install_requires_nothing_but_the_users_torch() -> None:
    base = [r.name for r in _requirements() if _extra_of(r) is None]
    assert base == [], f"`pip install stepdoctor` must pull nothing; it would pull {base}"
    assert all(r.name.lower() != "torch" for r in _requirements()), "the package must never pin torch"


def test_server_extra_has_the_backend_but_not_hta() -> None:
    by_extra: dict[str | None, set[str]] = {}
    for r in _requirements():
        by_extra.setdefault(_extra_of(r), set()).add(r.name.lower())
    server = by_extra["server"] | by_extra["analyze"]  # server pulls stepdoctor[analyze]
    for needed in (
        "fastapi",
        "uvicorn",
        "sqlalchemy",
        "alembic",
        "plotly",
        "tensorboard",
        "numpy",
        "msgspec",
    ):
        assert needed in server, needed
    assert "holistictraceanalysis" not in server and "jupyterlab" not in server
    assert "holistictraceanalysis" in by_extra["hta"]
    assert {"pytest", "torch-tb-profiler"} <= by_extra["dev"]


def test_agent_imports_without_server_dependencies() -> None:
    # Fail any import of the server stack, then import the agent as a user would.
    code = """
import importlib.abc, sys
BLOCKED = {"fastapi", "sqlalchemy", "alembic", "uvicorn", "plotly", "pydantic", "stepdoctor_server",
           "stepdoctor_analysis", "stepdoctor_dashboard", "msgspec", "hta", "tensorboard"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import stepdoctor
print(hasattr(stepdoctor, "profile"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_console_script_does_not_load_the_agent() -> None:
    """``stepdoctor analyze``/``serve`` start without the profiler; ``stepdoctor.profile`` still resolves."""
    code = """
import sys
import stepdoctor.cli
loaded = "stepdoctor.profiler" in sys.modules
import stepdoctor
from stepdoctor import Profile
print(loaded, stepdoctor.profile.__module__, Profile.__name__, sorted(stepdoctor.__all__))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().split(maxsplit=3) == [
        "False",
        "stepdoctor.profiler",
        "Profile",
        "['NoopProfile', 'Profile', '__version__', 'profile']",
    ]


# A user's interpreter without the extra: the listed modules read as absent (sys.modules[name] = None
# makes both ``import`` and ``find_spec`` see no such module), then the console script runs.
WITHOUT_MODULES = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from stepdoctor.cli import main
raise SystemExit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    ("absent", "argv", "extra"),
    [
        ("numpy,msgspec", ["analyze", "trace.json.gz"], "analyze"),
        ("msgspec", ["analyze", "--help"], "analyze"),
        ("fastapi", ["serve"], "server"),
        ("uvicorn", ["serve", "--port", "1"], "server"),
        ("numpy", ["worker", "-n", "1"], "server"),
        ("sqlalchemy", ["token", "list", "--team", "default"], "server"),
        ("alembic", ["db", "upgrade"], "server"),
        ("fastapi_offline", ["serve"], "server"),
    ],
)
def test_a_missing_extra_is_one_line_naming_the_install(absent: str, argv: list[str], extra: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_MODULES, absent, *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert f"pip install 'stepdoctor[{extra}]'" in lines[0] and lines[0].startswith(f"stepdoctor {argv[0]}:")
    assert absent.split(",")[0] in lines[0]


def test_a_module_missing_mid_command_gets_the_same_hint() -> None:
    """A command that imports an extra lazily (HTA for ``--deep``) still ends in the one-line hint."""
    code = """
import sys
sys.modules["pandas"] = None
from stepdoctor import cli
import stepdoctor_analysis.cli.analyze as acli
def main(argv):
    import pandas  # noqa: F401 - what a lazily importing command does
acli.main = main
raise SystemExit(cli.main(["analyze", "x.json"]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "stepdoctor analyze: needs the 'hta' extra (pandas is not installed): pip install 'stepdoctor[hta]'"
    )


def test_sync_needs_no_extra() -> None:
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_MODULES, "numpy,msgspec,fastapi,hta", "sync", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "stepdoctor sync" in out.stdout


def test_the_clis_extra_modules_come_from_those_extras() -> None:
    """The dispatcher's table of modules per extra stays in step with pyproject.toml."""
    from importlib.metadata import packages_distributions

    from stepdoctor.cli import COMMANDS, EXTRA_MODULES

    providers = packages_distributions()
    for extra, modules in EXTRA_MODULES.items():
        declared = {r.name.lower() for r in _requirements() if _extra_of(r) == extra}
        if extra == "server":
            declared |= {r.name.lower() for r in _requirements() if _extra_of(r) == "analyze"}
        installed = _closure(declared)
        for module in modules:
            dists = {d.lower().replace("_", "-") for d in providers.get(module, [module])}
            assert dists & installed, f"{module} is not installed by stepdoctor[{extra}]"
    assert {command.extra for command in COMMANDS.values() if command.extra} <= set(EXTRA_MODULES)


def _compose_command() -> list[str] | None:
    """The compose client the Makefile (and so the README's ``make up``) uses, when installed."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    out = subprocess.run(
        ["make", "-s", "--no-print-directory", "print-compose"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    cmd = out.stdout.split()
    assert cmd in (["docker", "compose"], ["docker-compose"]), cmd
    if cmd == ["docker-compose"] and shutil.which("docker-compose") is None:
        return None  # the Makefile's fallback, and it is not installed either (make system-deps)
    return cmd


def test_docker_compose_file_is_valid() -> None:
    cmd = _compose_command()
    if cmd is None:
        pytest.skip("no docker compose client installed")
    args = (
        [*cmd, "-f", str(REPO / "docker-compose.yml"), "config", "--format", "json"]
        if cmd == ["docker", "compose"]
        else [*cmd, "-f", str(REPO / "docker-compose.yml"), "config"]
    )
    env = {k: v for k, v in os.environ.items() if k not in ("POSTGRES_PASSWORD", "S3_SECRET_KEY")}
    # Secrets have no defaults: without them the file refuses to render.
    refused = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert refused.returncode != 0 and "set POSTGRES_PASSWORD" in refused.stderr
    env.update(POSTGRES_PASSWORD="test-password", S3_SECRET_KEY="test-secret")
    out = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    if cmd == ["docker", "compose"]:
        services = json.loads(text)["services"]
        assert services["migrate"]["depends_on"]["db"]["condition"] == "service_healthy"
        assert services["api"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert services["api"]["ports"][0]["host_ip"] == "127.0.0.1"
    else:
        assert "service_healthy" in text and "service_completed_successfully" in text
        assert "127.0.0.1:8000:8000" in text or "host_ip: 127.0.0.1" in text
    assert "healthcheck" in text and "pg_isready" in text
    assert "--workers" in text and "worker" in text


def _closure(names: set[str]) -> set[str]:
    """Distributions in ``names`` and everything they require (unconditionally), recursively."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import requires as dist_requires

    seen: set[str] = set()
    todo = [n.lower() for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = dist_requires(name) or []
        except PackageNotFoundError:
            continue
        for raw in reqs:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name.lower())
    return {n.replace("_", "-") for n in seen}


def test_server_modules_import_only_what_the_server_extra_installs() -> None:
    import ast
    from importlib.metadata import packages_distributions

    extras = {"server", "analyze"}
    declared = {r.name.lower() for r in _requirements() if _extra_of(r) in extras}
    installed = _closure(declared)
    providers = packages_distributions()
    missing: dict[str, str] = {}
    for root in ("backend", "frontend", "migrations"):
        for py in (REPO / root).rglob("*.py"):
            for node in ast.parse(py.read_text()).body:  # module level: what importing the module needs
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module]
                    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    else []
                )
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top.startswith("stepdoctor") or top == "__future__":
                        continue
                    dists = {d.lower().replace("_", "-") for d in providers.get(top, [top])}
                    if not dists & installed:
                        missing[f"{py.relative_to(REPO)}: {name}"] = ", ".join(sorted(dists))
    assert not missing, f"imported at module level but not installed by stepdoctor[server]: {missing}"


@pytest.mark.parametrize(
    ("module", "absent", "extra"),
    [
        ("stepdoctor.integrations.lightning", "lightning,pytorch_lightning", "lightning"),
        ("stepdoctor.integrations.transformers", "transformers", "transformers"),
        ("stepdoctor.integrations.accelerate", "accelerate", "accelerate"),
    ],
)
def test_an_integration_without_its_framework_names_the_extra(module: str, absent: str, extra: str) -> None:
    code = f"""
import sys
for name in {absent!r}.split(","):
    sys.modules[name] = None
import stepdoctor.integrations
try:
    import {module}
except ImportError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"pip install 'stepdoctor[{extra}]'" in out.stdout


def test_every_variable_is_documented() -> None:
    """Every STEPDOCTOR_* variable read anywhere in the packages (agent, engine, server, dashboard)."""
    import re

    used = set()
    for folder in ("agent", "backend", "frontend"):
        for py in (REPO / folder).rglob("*.py"):
            used |= set(re.findall(r"\bSTEPDOCTOR_[A-Z_]+\b", py.read_text()))
    readme = (REPO / "README.md").read_text()
    missing = {v for v in used if f"`{v}`" not in readme}
    assert used and not missing, f"add them to the README's table: {sorted(missing)}"


def _readme_section(heading: str) -> str:
    """The README's text under ``heading`` (e.g. ``## Install``) up to the next heading of its level or above."""
    import re

    level = len(heading) - len(heading.lstrip("#"))
    found = re.search(
        rf"^{re.escape(heading)}\n(.*?)(?=^#{{1,{level}}} )", (REPO / "README.md").read_text(), re.S | re.M
    )
    assert found, f"the README has no section '{heading}'"
    return found.group(1)


def test_the_readme_names_every_mcp_tool() -> None:
    """The README's MCP section lists each tool the server offers, as `name(`."""
    import asyncio

    pytest.importorskip("mcp")
    from mcp import Client

    from stepdoctor_server.mcp_server import LocalBackend, build_server

    async def tools() -> set[str]:
        async with Client(build_server(LocalBackend(REPO))) as client:
            return {t.name for t in (await client.list_tools()).tools}

    section = _readme_section("## Coding agents: `stepdoctor mcp`")
    names = asyncio.run(tools())
    assert names and not {n for n in names if f"`{n}(" not in section}


def test_the_readme_names_every_value_logged_to_the_trackers() -> None:
    from stepdoctor.integrations.trackers import step_summary, verdict_record

    logged = {*verdict_record("http://s", 1, {}), *step_summary([1.0]), "windows"}
    section = _readme_section("### The verdict in W&B and MLflow")
    assert not {k for k in logged if f"`{k}`" not in section}
    for name in ("read_token", "tracker_interval", "tracker_timeout"):  # the Session's own options
        assert f"`{name}" in section


def test_the_readmes_compose_secrets_go_into_a_file_compose_reads(tmp_path: Path) -> None:
    """The README's one line that writes ``.env`` gives the compose file both secrets, and no others."""

    cmd = _compose_command()
    if cmd is None:
        pytest.skip("no docker compose client installed")
    install = _readme_section("## Install")
    (line,) = [ln for ln in install.splitlines() if ln.startswith("printf ") and "> .env" in ln]
    shutil.copy2(REPO / "docker-compose.yml", tmp_path / "docker-compose.yml")
    env = {k: v for k, v in os.environ.items() if k not in ("POSTGRES_PASSWORD", "S3_SECRET_KEY")}
    subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, check=True, timeout=60)
    secrets = dict(ln.split("=", 1) for ln in (tmp_path / ".env").read_text().splitlines())
    assert set(secrets) == {"POSTGRES_PASSWORD", "S3_SECRET_KEY"} and all(
        len(v) >= 32 for v in secrets.values()
    )
    out = subprocess.run([*cmd, "config"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert secrets["POSTGRES_PASSWORD"] in out.stdout and secrets["S3_SECRET_KEY"] in out.stdout


def _install_table() -> dict[str, str]:
    """The README Install section's table: each thing a user runs (a backticked name) -> its row's needs."""
    import re

    needs: dict[str, str] = {}
    for row in re.findall(r"^\|(.+)\|(.+)\|$", _readme_section("## Install"), re.M):
        for name in re.findall(r"`([^`]+)`", row[0]):
            needs[name] = row[1]
    return needs


def test_the_readme_says_which_extra_each_command_and_integration_needs() -> None:
    import re

    from stepdoctor.cli import COMMANDS

    table = _install_table()
    for name, command in COMMANDS.items():
        row = table.get(f"stepdoctor {name}")
        assert row is not None, f"`stepdoctor {name}` is missing from the README's Install table"
        assert (f"[{command.extra}]" in row) if command.extra else ("nothing" in row), (name, row)
    for module in (REPO / "agent" / "stepdoctor" / "integrations").glob("[!_]*.py"):
        hint = re.search(r"pip install 'stepdoctor\[(\w+)\]'", module.read_text())
        if hint is None:  # needs no extra (e.g. trackers: only what the training process imported)
            continue
        row = table.get(f"stepdoctor.integrations.{module.stem}")
        assert row is not None and f"[{hint.group(1)}]" in row, (module.stem, row)
