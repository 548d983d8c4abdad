"""``model.arrays``: numpy's unique, percentile and median answers, bit for bit, without numpy.ma.

numpy 2's ``np.unique`` (plain), ``np.percentile`` and ``np.median`` of floats reach ``np.ma``, whose
first use imports numpy.ma (~11 ms of every ``stepdoctor analyze``); the helpers must still return
exactly numpy's values, or reports would change.
"""

from __future__ import annotations

import numpy as np
import pytest

from stepdoctor_analysis.model.arrays import distinct, median_of, percentiles
from support.fixtures import TRACES
from support.fresh_process import analyze_fresh

RNG = np.random.default_rng(7)
SIZES = [1, 2, 3, 4, 5, 17, 100, 1001]


def _arrays(kinds: str) -> list[np.ndarray]:
    out = []
    for n in SIZES:
        if "i" in kinds:
            out += [RNG.integers(-(10**12), 10**12, n), RNG.integers(0, 3, n).astype(np.int32)]
            out += [RNG.integers(0, 60000, n).astype(np.uint16), RNG.integers(0, 2, n).astype(np.bool_)]
        if "f" in kinds:
            out += [RNG.normal(0, 1e6, n), RNG.uniform(0, 1, n).astype(np.float32)]
    return out


@pytest.mark.parametrize("values", _arrays("i"), ids=lambda a: f"{a.dtype}[{a.size}]")
def test_distinct_is_np_unique(values: np.ndarray) -> None:
    got, want = distinct(values), np.unique(values)
    assert got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.parametrize(
    "values", [a for a in _arrays("i") if a.dtype != np.bool_], ids=lambda a: f"{a.dtype}[{a.size}]"
)
def test_percentiles_are_np_percentile(values: np.ndarray) -> None:
    for qs in [(50, 90, 99), (0, 100), (12.5, 33.3, 66.7, 87.5), tuple(RNG.uniform(0, 100, 5))]:
        got, want = percentiles(values, qs), np.percentile(values, qs)
        assert got.dtype == want.dtype and np.array_equal(got, want), qs


@pytest.mark.parametrize("values", _arrays("if"), ids=lambda a: f"{a.dtype}[{a.size}]")
def test_median_of_is_np_median(values: np.ndarray) -> None:
    assert median_of(values) == float(np.median(values))


def test_floats_with_nan_and_empty_arrays_keep_numpys_answer() -> None:
    x = np.array([1.0, np.nan, 3.0])
    assert np.isnan(median_of(x)) and np.array_equal(distinct(x), np.unique(x), equal_nan=True)
    empty = np.array([], np.int64)
    for f in (np.percentile, percentiles):  # numpy refuses an empty array; so do the helpers
        with pytest.raises(IndexError):
            f(empty, (50,))


def test_analyzing_a_gpu_trace_never_imports_numpy_ma() -> None:
    """The whole ``stepdoctor analyze`` of a GPU trace, in a fresh process: numpy.ma stays out."""
    trace = TRACES / "hta" / "df_index_resolver" / "df_index_resolver.json.gz"
    assert (
        analyze_fresh(trace, args=["--format", "json"], after="print('numpy.ma' in sys.modules)") == "False"
    )
