"""The suite needs nothing outside the repository: a fresh ``git clone`` (with nothing beside it) has
every fixture, no test names a path outside the tree, and a representative part of the suite
passes there while an audit hook records every file it opens or lists outside the clone."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Tests that read the fixture traces (engine, diagnosis, memory) plus the server fixtures they load.
SUBSET = ("tests/test_diagnosis_fixtures.py", "tests/test_engine_parse.py", "tests/test_memory_series.py")
# A string that names the workspace around the repository, anywhere in a test...
WORKSPACE = re.compile(r"^/work(/|$)|(^|/)shared/")
# ...or, where it builds a path (argument of Path()/open()/os.path.*, operand of ``/``), climbs out.
CLIMBS = re.compile(r"(^|[/\\])\.\.([/\\]|$)")
PATH_CALLS = frozenset(
    {"Path", "PurePath", "open", "join", "joinpath", "abspath", "realpath", "normpath", "chdir",
     "listdir", "scandir", "glob", "rglob", "isfile", "isdir", "exists", "fixture", "load_trace"}
)  # fmt: skip

AUDIT_PLUGIN = '''
"""Loaded with -p before any test module: records file access outside the clone."""
import json, os, sys

FORBIDDEN = json.loads(os.environ["SD_AUDIT_FORBIDDEN"])
ALLOWED = json.loads(os.environ["SD_AUDIT_ALLOWED"])
SEEN = []


def _hook(event, args):
    if event not in ("open", "os.listdir", "os.scandir", "glob.glob") or not args:
        return
    path = args[0]
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str):
        return
    path = os.path.abspath(path)
    if any(path == p or path.startswith(p + os.sep) for p in FORBIDDEN) and not any(
        path == a or path.startswith(a + os.sep) for a in ALLOWED
    ):
        SEEN.append(f"{event} {path}")


sys.addaudithook(_hook)


def pytest_sessionfinish(session, exitstatus):
    import stepdoctor, stepdoctor_analysis, stepdoctor_server

    modules = {m.__name__: m.__file__ for m in (stepdoctor, stepdoctor_analysis, stepdoctor_server)}
    with open(os.environ["SD_AUDIT_OUT"], "w") as out:
        json.dump({"outside": sorted(set(SEEN)), "modules": modules}, out)
'''


def _escapes(node: ast.expr, depth: int) -> bool:
    """``Path(__file__)...parents[k]`` / ``.parent.parent`` climbing above the repository root."""
    levels = 0
    while True:
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "parents"
        ):
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int):
                levels += node.slice.value + 1
            node = node.value.value
        elif isinstance(node, ast.Attribute) and node.attr == "parent":
            levels += 1
            node = node.value
        elif isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func if not node.args else node.args[0]
        else:
            break
    return isinstance(node, ast.Name) and node.id == "__file__" and levels > depth + 1


def _path_operands(tree: ast.AST) -> list[ast.expr]:
    """Expressions used to build a path: call arguments of path functions and operands of ``/``."""
    out: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            if name in PATH_CALLS:
                out += node.args
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            out += [node.left, node.right]
    return out


def outside_references(root: Path) -> list[str]:
    """Every place in the tests that names a path outside ``root`` (static, over the whole tree)."""
    found = []
    for py in sorted((root / "tests").rglob("*.py")):
        rel = py.relative_to(root)
        depth = len(rel.parts) - 1  # folders between the root and the file: depth + 1 levels up is the root
        tree = ast.parse(py.read_text(), filename=str(rel))
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        in_paths = {id(arg) for arg in _path_operands(tree)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if py.name == Path(__file__).name:
                    continue
                if WORKSPACE.search(node.value) or (id(node) in in_paths and CLIMBS.search(node.value)):
                    found.append(f"{rel}:{node.lineno}: {node.value[:80]!r}")
            elif isinstance(node, (ast.Subscript, ast.Attribute)) and _escapes(node, depth):
                found.append(f"{rel}:{node.lineno}: climbs above the repository root")
    return sorted(set(found))


def test_no_test_names_a_path_outside_the_repository() -> None:
    assert outside_references(REPO) == []


def test_the_checker_sees_an_escape(tmp_path: Path) -> None:
    (tmp_path / "tests" / "support").mkdir(parents=True)
    (tmp_path / "tests" / "support" / "x.py").write_text(
        "from pathlib import Path\n"
        "OK = Path(__file__).resolve().parents[2] / 'tests' / 'fixtures'\n"
        "BAD = Path(__file__).resolve().parents[3] / 'traces'\n"
        "ALSO_BAD = Path(__file__).parent.parent.parent.parent\n"
        "WORSE = '/work/shared/fixtures/traces'\n"
        "ALSO = Path('..', 'fixtures') / '../traces'\n"
        "NAME = {'project': '../x'}  # an attack string, not a path\n"
    )
    found = outside_references(tmp_path)
    assert [int(line.split(":")[1]) for line in found] == [3, 4, 5, 6, 6], found


def _workspace_siblings(tmp_path: Path, venv: Path) -> list[Path]:
    """Every folder beside this checkout (whatever the workspace keeps there), except those holding
    the test's own temporary folder or the interpreter: the clone must read none of them."""
    keep = (tmp_path.resolve(), venv.resolve())
    return [
        p
        for p in REPO.parent.iterdir()
        if p.is_dir() and p.resolve() != REPO and not any(k.is_relative_to(p.resolve()) for k in keep)
    ]


@pytest.mark.slow
def test_a_fresh_clone_with_nothing_beside_it_passes_with_no_access_outside_it(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=300)
    assert [p.name for p in tmp_path.iterdir()] == ["clone"]  # nothing beside the clone
    assert (clone / "tests" / "fixtures" / "traces").is_dir()
    assert outside_references(clone) == []

    # The clone's code, not the editable install's: its source folders first on the path, and the
    # migrations folder under its package name.
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "stepdoctor_migrations").symlink_to(clone / "migrations", target_is_directory=True)
    (shim / "sd_audit.py").write_text(AUDIT_PLUGIN)
    report = tmp_path / "audit.json"
    venv = Path(sys.prefix)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPDOCTOR_")}
    env.update(
        PYTHONPATH=os.pathsep.join(
            str(p) for p in (clone / "agent", clone / "backend", clone / "frontend", shim)
        ),
        SD_AUDIT_OUT=str(report),
        SD_AUDIT_FORBIDDEN=json.dumps([str(REPO), *map(str, _workspace_siblings(tmp_path, venv))]),
        SD_AUDIT_ALLOWED=json.dumps([str(venv), str(REPO / ".venv")]),
        PYTHONDONTWRITEBYTECODE="1",
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "sd_audit", "-p", "no:cacheprovider", "-q", "-m", "not slow",
         "-k", "not postgresql", *SUBSET],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    summary = out.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
    audit = json.loads(report.read_text())
    assert all(path.startswith(str(clone)) for path in audit["modules"].values()), audit["modules"]
    assert audit["outside"] == [], "read outside the clone:\n" + "\n".join(audit["outside"][:20])
