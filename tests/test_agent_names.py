"""The agent accepts exactly the names the server accepts, so a run never uploads into a 422."""

from __future__ import annotations

import pytest

from stepdoctor.config import sanitize_name, valid_name


@pytest.mark.parametrize("name", ["abc\n", "abc\r", ".hidden", "a/b", "", "r" * 129, "rün"])
def test_names_the_server_refuses_are_invalid(name: str) -> None:
    assert not valid_name(name)


@pytest.mark.parametrize(
    ("raw", "clean"), [("abc\n", "abc"), ("my run/1", "my-run-1"), ("..x", "x"), ("\n", "fallback")]
)
def test_sanitized_names_are_valid(raw: str, clean: str) -> None:
    assert sanitize_name(raw, "fallback") == clean
    assert valid_name(sanitize_name(raw, "fallback"))
