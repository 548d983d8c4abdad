"""``stepdoctor analyze`` in a new interpreter, with code run before and after it: for what only a
fresh process shows (which modules a run imports, and when)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def analyze_fresh(trace: Path, *, after: str, before: str = "", args: Sequence[str] = ()) -> str:
    """What ``after`` prints once ``main(['analyze', *args, trace])`` returned 0 (its report is
    swallowed); ``before`` runs first, after the imports of ``contextlib``, ``io`` and ``sys``."""
    script = (
        "import contextlib, io, sys\n"
        f"{before}\n"
        "from stepdoctor.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['analyze', *{list(args)!r}, {str(trace)!r}]) == 0\n"
        f"{after}\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()
