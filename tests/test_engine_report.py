"""``report.plain``: what a JSON round trip of the report carries, independent of its input."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from stepdoctor_analysis.report.document import plain


@dataclass
class _Row:
    name: str
    value: float


def test_plain_converts_numpy_dataclasses_and_non_finite_values() -> None:
    src = {"a": np.int64(3), "b": np.float32(0.5), "c": np.arange(3), "d": (1, 2), "e": _Row("x", math.nan)}
    src["f"] = {1: math.inf, "g": [np.bool_(True)]}
    out = plain(src)
    assert out == {
        "a": 3,
        "b": 0.5,
        "c": [0, 1, 2],
        "d": [1, 2],
        "e": {"name": "x", "value": None},
        "f": {"1": None, "g": [True]},
    }
    assert type(out["a"]) is int and type(out["f"]["g"][0]) is bool
    assert plain(0.1 + 0.2) == 0.1 + 0.2  # floats come back bit for bit


def test_plain_shares_nothing_with_its_input() -> None:
    inner = {"k": [1, 2]}
    out = plain({"inner": inner})
    out["inner"]["k"].append(3)
    assert inner == {"k": [1, 2]}


def test_plain_names_an_unsupported_type() -> None:
    with pytest.raises(TypeError, match="object"):
        plain({"x": object()})
