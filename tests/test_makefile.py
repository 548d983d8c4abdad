"""The Makefile as the README uses it: ``make help`` shows values, ``make check`` is lint + mypy only,
``make test LINT=0`` skips them, CI runs the README's test command, ``make clean`` removes the data
directory the demo writes into (its spool included: tests/test_server_analysis_demo.py)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


# make's own state and the Makefile's knobs: a parent `make test LINT=0` exports them to its children.
_MAKE_STATE = frozenset(
    {
        "MAKEFLAGS",
        "MFLAGS",
        "MAKELEVEL",
        "MAKEOVERRIDES",
        "LINT",
        "PYTEST_ARGS",
        "PYTEST_WORKERS",
        "TORCH_SPEC",
        "HOST",
        "PORT",
    }
    | {"COMPOSE", "PYTHON", "VENV"}
)


def make(*args: str) -> str:
    """``make ARGS`` in the repository, hermetic: nothing of a calling make or of STEPDOCTOR_* leaks in."""
    env = {k: v for k, v in os.environ.items() if k not in _MAKE_STATE and not k.startswith("STEPDOCTOR_")}
    done = subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def described_targets() -> list[str]:
    return re.findall(r"^([a-z-]+):.*## ", (REPO / "Makefile").read_text(), re.M)


def help_lines(*overrides: str) -> dict[str, str]:
    lines = [line.split(maxsplit=1) for line in make("help", *overrides).splitlines() if line.strip()]
    return {parts[0]: parts[1] if len(parts) > 1 else "" for parts in lines}


def test_help_lists_every_target_with_the_values_it_will_use() -> None:
    overrides = {
        "TORCH_SPEC": "torch==9.8.7",
        "HOST": "10.9.8.7",
        "PORT": "4321",
        "COMPOSE": "podman compose",
        "STEPDOCTOR_DATA_DIR": "/srv/sd-data",
    }
    shown = help_lines(*(f"{k}={v}" for k, v in overrides.items()))
    assert list(shown) == described_targets()
    text = "\n".join(shown.values())
    assert "$(" not in text and "$$" not in text, text
    assert "torch==9.8.7" in shown["install-server"]
    assert "http://10.9.8.7:4321" in shown["demo"] and "/srv/sd-data" in shown["demo"]
    assert "with podman compose (" in shown["up"]
    # Without overrides: the defaults, e.g. the compose client `make up` runs (print-compose).
    defaults = help_lines()
    compose = make("-s", "print-compose").strip()
    assert f"with {compose} (" in defaults["up"] and f"{REPO}/stepdoctor-data" in defaults["demo"]
    assert "$(" not in "\n".join(defaults.values())


def _recipe(*args: str) -> list[str]:
    """The commands ``make -n ARGS`` would run."""
    return [line.strip() for line in make("-n", *args).splitlines() if line.strip()]


def _runs(commands: list[str], tool: str) -> bool:
    return any(Path(c.split()[0]).name == tool for c in commands)


def test_check_is_lint_and_typecheck_only() -> None:
    commands = _recipe("check")
    assert any("ruff check" in c for c in commands) and any("ruff format --check" in c for c in commands)
    assert _runs(commands, "mypy")
    assert not any("pytest" in c or "pip install" in c for c in commands), commands


def test_test_runs_check_unless_lint_is_0() -> None:
    full = _recipe("test", "PYTEST_ARGS=-x -q tests/test_makefile.py")
    assert any("ruff check" in c for c in full) and _runs(full, "mypy")
    assert "-m pytest " in full[-1] and full[-1].endswith(" -x -q tests/test_makefile.py"), full
    quick = _recipe("test", "LINT=0", "PYTEST_ARGS=-x -q tests/test_makefile.py")
    assert not any("ruff" in c or "mypy" in c for c in quick), quick
    assert quick[-1] == full[-1]


def test_test_runs_the_suite_in_worker_processes_unless_told_0() -> None:
    parallel = _recipe("test", "LINT=0", "PYTEST_ARGS=-q")[-1]
    assert "-m pytest -n 2 --dist loadfile -q" in parallel, parallel
    serial = _recipe("test", "LINT=0", "PYTEST_WORKERS=0", "PYTEST_ARGS=-q")[-1]
    assert serial.endswith("-m pytest -q") and " -n " not in serial, serial


def test_ci_runs_the_readmes_test_command_with_lint() -> None:
    readme = (REPO / "README.md").read_text()
    quick_start = re.search(r"^## Quick start\n(.*?)(?=^## )", readme, re.S | re.M)
    assert quick_start
    (block,) = re.findall(r"```bash\n(.*?)```", quick_start.group(1), re.S)
    commands = [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines()]
    assert "make test" in commands, commands
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert ci[-1] == "exec make test", "CI must run the README's test command as written (lint included)"


def test_clean_removes_the_data_directory_the_demo_uses() -> None:
    demo_data = re.search(r"\(data in (\S+)\)", help_lines()["demo"])
    assert demo_data, help_lines()["demo"]
    (rm,) = [c for c in _recipe("clean") if c.startswith("rm -rf")]
    removed = {(REPO / word).resolve() for word in shlex.split(rm)[2:]}
    assert Path(demo_data.group(1)).resolve() in removed, rm
    assert (REPO / "dist").resolve() in removed  # what `make wheel` builds


def test_wheel_builds_as_the_readme_says() -> None:
    readme = (REPO / "README.md").read_text()
    documented = re.search(r"^python -m pip wheel [^#\n]*?(?=\s*(#|$))", readme, re.M)
    assert documented, "the README's Install section builds the wheel with `python -m pip wheel`"
    (command,) = [c for c in _recipe("wheel") if "pip wheel" in c]
    assert command.split(maxsplit=1)[1] == documented.group(0).split(maxsplit=1)[1], command
