"""Suite-wide fixtures and marker handling.

Markers skip with a stated reason when their resource is missing, so the suite passes on a machine
without PostgreSQL, Chromium or a GPU while running everything it can.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "traces"


def _server_plugins() -> list[str]:
    # The server fixtures need the server extra; the agent-only tests must still collect without it.
    return ["support.server"] if (REPO / "tests" / "support" / "server.py").exists() else []


pytest_plugins = _server_plugins()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _other_backend(item: pytest.Item) -> bool:
    """A test marked ``only_db(...)`` whose ``db_url`` parametrization names another backend."""
    marker = item.get_closest_marker("only_db")
    callspec = getattr(item, "callspec", None)
    backend = callspec.params.get("db_url") if callspec is not None else None
    return marker is not None and backend is not None and backend not in marker.args


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Backend-specific tests are deselected for the other backend, not skipped: a skip is kept for
    # a resource this machine lacks.
    other = [item for item in items if _other_backend(item)]
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = [item for item in items if not _other_backend(item)]
    chromium = shutil.which("chromium") or os.path.exists("/usr/bin/chromium")
    has_gpu = None
    for item in items:
        if "browser" in item.keywords and not chromium:
            item.add_marker(pytest.mark.skip(reason="Debian chromium is not installed (make system-deps)"))
        if "gpu" in item.keywords:
            if has_gpu is None:
                has_gpu = _cuda_available()
            if not has_gpu:
                item.add_marker(pytest.mark.skip(reason="no CUDA device on this machine"))


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The real Kineto traces kept under tests/fixtures/traces (licenses beside them)."""
    return FIXTURES
