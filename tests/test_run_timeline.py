"""The engine's step-series reader: chunks validated (bad ones refused in one line), the run timeline's
numbers, the anomaly rule against a plain re-implementation, and compare()'s basis."""

from __future__ import annotations

import array
import json
import struct
import zlib
from typing import Any

import numpy as np
import pytest

from stepdoctor.series import MAGIC, block_median, encode_chunk
from stepdoctor_analysis.run import timeline as rt


def chunk(
    walls: list[int],
    *,
    first: int = 0,
    seq: int = 0,
    stream: str = "s1",
    data: list[int] | None = None,
    mem: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], []),
    **header: Any,
) -> bytes:
    """A chunk as the agent writes it (stepdoctor.series.encode_chunk)."""
    head = {
        "format": 1,
        "kind": "stepdoctor.series",
        "stream": stream,
        "seq": seq,
        "rank": 0,
        "first_step": first,
        "count": len(walls),
        "t_end": 1.0,
        "final": False,
        "anomaly": {"k": 1.5, "window": 50, "warmup": 50, "min_ms": 1.0},
        "profiled": [],
        "windows": [],
        "anomalies": [],
        **header,
    }
    cols = [("wall_ns", walls), ("data_ns", data if data is not None else [-1] * len(walls))]
    cols += list(zip(("mem_step", "mem_kind", "mem_a", "mem_b"), mem, strict=True))
    return encode_chunk(head, [(name, array.array("q", values)) for name, values in cols])


def rebuilt(data: bytes, **changes: Any) -> bytes:
    """``data`` with header keys changed, columns kept as they are."""
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    head = json.loads(data[start : start + n]) | changes
    raw = json.dumps(head).encode()
    return MAGIC + struct.pack("<I", len(raw)) + raw + data[start + n :]


GOOD = chunk([10_000_000] * 20)


def with_body(data: bytes, body: bytes) -> bytes:
    """``data``'s magic and header with another compressed body."""
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    return data[: len(MAGIC) + 4 + n] + body


def test_a_chunk_the_agent_writes_reads_back_exactly() -> None:
    data = chunk([5, 6, 7], data=[1, -1, 2], mem=([11], [0], [4096], [-1]), first=10)
    c = rt.validate_chunk(data)
    assert (c.first_step, c.last_step, c.seq, c.stream, c.rank) == (10, 12, 0, "s1", 0)
    assert c.wall_ns.tolist() == [5, 6, 7] and c.data_ns.tolist() == [1, -1, 2]
    assert (c.mem_step.tolist(), c.mem_a.tolist()) == ([11], [4096])


BAD: dict[str, tuple[bytes, str]] = {
    "not a chunk": (b"PK\x03\x04 a zip file", "bad magic"),
    "header past the end": (MAGIC + struct.pack("<I", 10**5) + b"{}", "past the end"),
    "header not JSON": (MAGIC + struct.pack("<I", 3) + b"{x}", "not JSON"),
    "NaN in the header": (rebuilt(GOOD, t_end=float("nan")), "NaN"),
    "Infinity deep in the header": (rebuilt(GOOD, anomaly={"k": float("inf")}), "Infinity"),
    "another format": (rebuilt(GOOD, format=2), "format 2"),
    "negative first step": (rebuilt(GOOD, first_step=-1), "first_step"),
    "count not the column length": (rebuilt(GOOD, count=21), "count=21"),
    "columns in another order": (
        rebuilt(GOOD, columns=[["data_ns", "<i8", 20], ["wall_ns", "<i8", 20]]),
        "columns must be",
    ),
    "a float column": (
        rebuilt(
            GOOD,
            columns=[["wall_ns", "<f8", 20], ["data_ns", "<i8", 20]]
            + [[n, "<i8", 0] for n in rt.MEMORY_COLUMNS],
        ),
        "dtype '<f8'",
    ),
    "body cut short": (GOOD[:-5], "not the 320 bytes"),
    "a zlib bomb": (with_body(GOOD, zlib.compress(b"\0" * 10**8, 9)), "not the 320 bytes"),
    "data after the stream": (with_body(GOOD, zlib.compress(b"\0" * 320) + b"more"), "not the 320 bytes"),
    "a body that is not zlib": (with_body(GOOD, b"\x00" * 320), "do not decompress"),
    "a negative step time": (chunk([5, -1]), "step times must be >= 0"),
    "memory samples going back": (
        chunk([5, 6, 7], mem=([2, 1], [0, 0], [1, 1], [-1, -1])),
        "increasing steps",
    ),
    "a memory kind nobody knows": (chunk([5], mem=([0], [7], [1], [1])), "mem_kind"),
    "profiled range past the chunk": (chunk([5, 6], profiled=[[0, 5]]), "profiled range"),
    "profiled ranges out of order": (chunk([5, 6, 7], profiled=[[2, 2], [0, 0]]), "profiled range"),
    "an anomaly outside the chunk": (chunk([5], anomalies=[{"step": 9}]), "anomaly at step 9"),
    "over the size limit": (GOOD + b"\0" * rt.MAX_CHUNK_BYTES, "byte limit"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_chunk_is_refused_in_one_line(name: str) -> None:
    data, words = BAD[name]
    with pytest.raises(rt.SeriesError) as err:
        rt.validate_chunk(data)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_steps_must_keep_increasing_across_chunks() -> None:
    with pytest.raises(rt.SeriesError, match="not after step 19"):
        rt.validate_chunk(chunk([1, 2], first=15), after_step=19)
    with pytest.raises(rt.SeriesError, match="steps go back"):
        rt.run_timeline([chunk([1] * 20), chunk([1] * 5, first=10, seq=1)])


def test_a_resent_chunk_counts_once_and_a_lost_one_shows_as_missing() -> None:
    a, b, c = chunk([1] * 20), chunk([1] * 20, first=20, seq=1), chunk([1] * 20, first=40, seq=2)
    assert rt.run_timeline([c, a, a, b]).steps == 60
    gap = rt.run_timeline([a, c])
    assert (gap.steps, gap.missing_steps) == (40, 20)


def plain_anomalies(
    walls: list[int], profiled: set[int], k: float, window: int, warmup: int, min_ms: float, post: int
) -> set[int]:
    """The agent's rule written out step by step: a reference from each full block of ``window``
    steps (from step ``warmup``) that is at least half unprofiled, applied to the steps after it,
    except the ``post`` steps right after a profiled one."""
    hits, ref, quiet_until = set(), None, -1
    for step, wall in enumerate(walls):
        if step in profiled:
            quiet_until = step + post
        elif ref is not None and step > quiet_until and wall > max(int(k * ref), ref + int(min_ms * 1e6)):
            hits.add(step)
        if step >= warmup + window - 1 and (step - warmup + 1) % window == 0:
            block = [walls[s] for s in range(step - window + 1, step + 1) if s not in profiled]
            if 2 * len(block) >= window:
                ref = block_median(block)
    return hits


def test_anomalies_follow_the_agents_rule_at_every_step() -> None:
    rng = np.random.default_rng(7)
    walls = rng.normal(10e6, 1.5e6, 3000).clip(1e6).astype(np.int64)
    walls[[400, 401, 1500, 2222]] = 40_000_000
    walls[2000:2100] *= 3  # a lasting slowdown: flagged until it is the new median
    profiled = set(range(100, 130)) | set(range(1990, 2005))
    steps = np.arange(3000)
    walls[1230:1236] = 40_000_000  # right after a window: the agent does not count those
    profiled |= set(range(1220, 1230))
    mask = np.isin(steps, sorted(profiled))
    found = rt.detect_anomalies(steps, walls, mask, k=1.5, window=50, warmup=50, min_ms=1.0, post_window=5)
    expected = plain_anomalies(walls.tolist(), profiled, 1.5, 50, 50, 1.0, 5)
    assert set(steps[found].tolist()) == expected
    assert {400, 401, 1500, 2222, 1235} <= expected and 2150 not in expected
    assert not expected & set(range(1230, 1235)) and not expected & set(range(2005, 2010))


def test_the_timeline_counts_steady_unprofiled_steps_and_lists_windows_and_anomalies() -> None:
    walls = [50_000_000] * 50 + [10_000_000] * 250  # a slow warm-up, then 10 ms steps
    walls[20 + 50 : 25 + 50] = [30_000_000] * 5  # a profiled window: slower, not steady
    walls[200] = 100_000_000
    data = chunk(
        walls,
        data=[2_000_000] * 300,
        profiled=[[70, 74]],
        windows=[{"first_step": 72, "last_step": 74, "reason": "schedule"}],
        final=True,
        mem=([0, 150], [0, 0], [100, 300], [-1, -1]),
    )
    t = rt.run_timeline([data])
    assert (t.steps, t.unprofiled_steps, t.warmup_steps, t.finished) == (300, 245, 50, True)
    assert (
        t.unprofiled_median_ms == 10.0 and t.profiled_median_ms == 30.0 and t.throughput_steps_per_s == 100.0
    )
    assert (
        t.step_time_ms.median == 10.0
        and t.data_wait_ms == 2.0
        and t.data_wait_share == pytest.approx(0.2, abs=0.01)
    )
    assert [(w.first_step, w.last_step, w.reason) for w in t.windows] == [(72, 74, "schedule")]
    assert [(a.first_step, a.last_step, a.max_ms, a.median_ms) for a in t.anomalies] == [
        (200, 200, 100.0, 10.0)
    ]
    assert t.memory is not None and (t.memory.kind, t.memory.peak_bytes, t.memory.last_bytes) == (
        "rss",
        300,
        300,
    )


def test_a_long_run_is_drawn_in_a_bounded_number_of_points_without_losing_a_spike() -> None:
    walls = [10_000_000] * 200_000
    walls[123_457] = 900_000_000
    parts = [chunk(walls[i : i + 50_000], first=i, seq=i // 50_000) for i in range(0, 200_000, 50_000)]
    t = rt.run_timeline(parts, points=500)
    d = t.display
    assert d.bucket == 400 and len(d.step) == len(d.max_ms) == 500 and max(d.max_ms) == 900.0
    assert d.step[d.max_ms.index(900.0)] <= 123_457 < d.step[d.max_ms.index(900.0)] + 400
    assert t.steps == 200_000 and [(a.first_step, a.max_ms) for a in t.anomalies] == [(123_457, 900.0)]


def test_compare_prefers_unprofiled_steps_and_says_so() -> None:
    base = rt.Side("base", unprofiled_median_ms=10.0, profiled_ms=30.0, verdict="input")
    slower = rt.Side("cand", unprofiled_median_ms=10.6, profiled_ms=29.0, verdict="compute")
    c = rt.compare(slower, base, max_regression=0.05)
    assert (c.basis, c.regression, c.change, c.verdict_changed) == ("unprofiled", True, 0.06, True)
    only_traces = rt.Side("cand", profiled_ms=29.0, verdict="input")
    c = rt.compare(only_traces, base)
    assert (c.basis, c.regression, c.verdict_changed) == ("profiled", False, False)
    with pytest.raises(rt.NothingComparable, match=r"only traces .* only a step series"):
        rt.compare(only_traces, rt.Side("base", unprofiled_median_ms=10.0))
