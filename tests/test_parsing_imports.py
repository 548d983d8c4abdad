"""The parsing package names its entry points lazily: a light sibling (``logdir``) imports alone.

``stepdoctor analyze --help`` and ``check``/``analyze`` before the engine loads import
``parsing.logdir``; importing it must not pull numpy, msgspec and the parser in with the package's
``__init__``, nor start numpy (and OpenBLAS's thread pool) before ``analyze`` limits it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("numpy", "msgspec", "stepdoctor_analysis.parsing.columns", "stepdoctor_analysis.model")


def _modules_after(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    modules: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return modules


@pytest.mark.parametrize(
    "code",
    [
        "from stepdoctor_analysis.parsing import logdir",
        "import stepdoctor_analysis.cli.analyze",
        "import contextlib, io\nfrom stepdoctor.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['analyze', '--help'])",
    ],
)
def test_light_parsing_imports_leave_the_parser_unloaded(code: str) -> None:
    loaded = [m for m in _modules_after(code) if m in HEAVY]
    assert loaded == []


def test_entry_points_load_on_first_use() -> None:
    from stepdoctor_analysis import parsing
    from stepdoctor_analysis.parsing import loading

    assert parsing.load_trace is loading.load_trace
    assert parsing.DEFAULT_MAX_BYTES == loading.DEFAULT_MAX_BYTES
    with pytest.raises(AttributeError):
        _ = parsing.no_such_name
