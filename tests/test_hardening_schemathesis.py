"""Property-based fuzzing of the whole API from its own OpenAPI (schemathesis), with an admin token,
on SQLite and PostgreSQL (#12): no generated request may end in a server error.

Bounded (a few examples per operation, derandomized, no example database), so each backend takes
about a minute. Only server errors are collected: documenting every 4xx per route is not
what this test is about; a 5xx always is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")

from support.server import bearer, synthetic_trace, upload  # noqa: E402

pytestmark = pytest.mark.slow
EXAMPLES = 40


@pytest.fixture
def seeded(app: FastAPI, admin_token: str) -> Iterator[str]:
    """A few real objects (ids 1..n exist), so generated ids hit rows as well as misses."""
    with TestClient(app, headers=bearer(admin_token)) as client:
        for run in ("a", "b"):
            assert upload(client, synthetic_trace(5), run=run, metadata={"tags": ["t1"]}).status_code == 201
    yield admin_token


def test_no_server_errors(app: FastAPI, seeded: str) -> None:
    """Every operation, ``EXAMPLES`` generated requests each (path, query, headers, bodies)."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    errors: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.generate],
        )
        def call(case: Any) -> None:
            response = case.call(headers=bearer(seeded))
            if response.status_code >= 500:
                errors.append(
                    f"{case.method} {case.formatted_path} query={case.query} -> {response.status_code}: "
                    f"{response.text[:200]}"
                )

        call()
    assert not errors, "\n".join(sorted(set(errors)))
