"""Bounded memory whatever a trace holds: whitespace padding, giant strings, deep nesting, bombs.

The 2 GiB whitespace bomb is built streaming (about 2 MB on disk: identical deflate blocks after
full flushes) and analysed in a child process whose peak RSS (``VmHWM``) is read back.
"""

from __future__ import annotations

import gzip
import json
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

from stepdoctor_analysis import parsing as parse
from stepdoctor_analysis.errors import TraceError
from stepdoctor_server.core.errors import ApiError
from stepdoctor_server.traces.ingest import MAX_COMPRESSION_RATIO, RATIO_CHECK_AFTER, BodyInspector

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _events(start: int, n: int) -> bytes:
    return b",".join(
        json.dumps(
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": f"aten::op{i % 7}",
                "pid": 1,
                "tid": 1,
                "ts": i * 10,
                "dur": 5,
            }
        ).encode()
        for i in range(start, start + n)
    )


def write_whitespace_bomb(path: Path, pad_bytes: int, *, block: int = MiB) -> int:
    """A valid gzip trace: 50 events, ``pad_bytes`` of spaces between two events, 50 more.

    After a full flush deflate restarts, so every padding block compresses to the same bytes and
    is written again without compressing it again; the CRC is still computed over every byte.
    Returns the decompressed size.
    """
    head = b'{"schemaVersion": 1, "traceEvents": [' + _events(0, 50) + b","
    tail = _events(50, 50) + b"]}"
    pad = b" " * block
    comp = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    crc, size = zlib.crc32(head), len(head)
    with path.open("wb") as out:
        out.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff")
        out.write(comp.compress(head) + comp.flush(zlib.Z_FULL_FLUSH))
        again = b""
        for i in range(pad_bytes // block):
            if i < 2:  # the first block after the header may differ; from the second on they repeat
                again = comp.compress(pad) + comp.flush(zlib.Z_FULL_FLUSH)
            out.write(again)
            crc = zlib.crc32(pad, crc)
        size += (pad_bytes // block) * block
        out.write(comp.compress(tail) + comp.flush())
        crc, size = zlib.crc32(tail, crc), size + len(tail)
        out.write(struct.pack("<II", crc & 0xFFFFFFFF, size & 0xFFFFFFFF))
    return size


_CHILD = textwrap.dedent(
    """
    import sys
    from stepdoctor_analysis.parsing import load_trace
    from stepdoctor_analysis.errors import TraceError
    try:
        trace = load_trace(sys.argv[1], max_bytes=8 << 30)
        outcome = "analysed"
    except TraceError as exc:
        outcome = "refused: " + str(exc)
    print(outcome)
    # VmHWM: this process's own peak (ru_maxrss would include the forking parent's size).
    status = open("/proc/self/status").read()
    print(int(next(l for l in status.splitlines() if l.startswith("VmHWM:")).split()[1]) * 1024)
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc for VmHWM")
def test_two_gib_whitespace_bomb_parses_in_bounded_memory(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.json.gz"
    decompressed = write_whitespace_bomb(bomb, 2048 * MiB)
    assert decompressed > 2 * 1024 * MiB and bomb.stat().st_size < 4 * MiB
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(bomb)], capture_output=True, text=True, cwd=REPO, check=True
    )
    outcome, peak = done.stdout.strip().splitlines()
    assert outcome == "analysed", outcome
    assert int(peak) < 300 * MiB, f"peak RSS {int(peak) / MiB:.0f} MiB"


def test_whitespace_padding_does_not_change_the_events(tmp_path: Path) -> None:
    plain = tmp_path / "plain.json.gz"
    padded = tmp_path / "padded.json.gz"
    write_whitespace_bomb(plain, 0)
    write_whitespace_bomb(padded, 16 * MiB)
    a, b = parse.load_trace(plain), parse.load_trace(padded)
    assert len(a.host.ts) == len(b.host.ts) == 100
    assert (a.host.ts == b.host.ts).all() and (a.host.name == b.host.name).all()


def write_long_names_trace(path: Path, n_events: int, name_chars: int) -> None:
    """``n_events`` events, each with its own ``name_chars``-long name and category (compressible)."""
    with gzip.open(path, "wb", compresslevel=1) as out:
        out.write(b'{"traceEvents": [')
        for i in range(n_events):
            name = str(i).encode() + (b"A" * name_chars)
            cat = str(i).encode() + (b"c" * name_chars)
            event = b'{"ph": "X", "cat": "%s", "name": "%s", "pid": 1, "tid": 1, "ts": %d, "dur": 1}'
            out.write((b"," if i else b"") + event % (cat, name, i * 10))
        out.write(b"]}")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc for VmHWM")
def test_long_distinct_names_cost_memory_per_event_not_per_character(tmp_path: Path) -> None:
    """3,000 events with distinct 100 KB names and categories: 600 MB of text, names cut to 8 KiB."""
    path = tmp_path / "names.json.gz"
    write_long_names_trace(path, 3000, 100_000)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, cwd=REPO, check=True
    )
    outcome, peak = done.stdout.strip().splitlines()
    assert outcome == "analysed", outcome
    assert int(peak) < 250 * MiB, f"peak RSS {int(peak) / MiB:.0f} MiB"


def test_long_names_are_cut_and_distinct_names_budgeted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stepdoctor_analysis.parsing import columns

    path = tmp_path / "names.json.gz"
    write_long_names_trace(path, 20, 10_000)
    trace = parse.load_trace(path)
    names = [trace.strings[i] for i in set(trace.host.name.tolist())]
    assert len(names) == 20 and all(len(n) == columns.MAX_NAME_CHARS for n in names)
    monkeypatch.setattr(columns, "MAX_NAMES_CHARS", 50_000)
    with pytest.raises(TraceError, match="event names total more than"):
        parse.load_trace(path)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"traceEvents": [{"ph": "X", "name": "' + b"A" * (80 * MiB) + b'"}]}', "not a sequence"),
        (b'{"pad": "' + b"B" * (80 * MiB) + b'", "traceEvents": [{"ph": "X"}]}', "not a sequence"),
        (b'{"traceEvents": [{"ph": "X", "args": ' + b"[" * 50_000 + b"]" * 50_000 + b"}]}", "nested"),
    ],
    ids=["giant-string", "giant-header", "deep-nesting"],
)
def test_giant_values_and_deep_nesting_are_refused(tmp_path: Path, body: bytes, message: str) -> None:
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(body, 1))
    with pytest.raises(TraceError, match=message):
        parse.load_trace(path)


def test_ingest_stops_inflating_an_implausible_ratio(tmp_path: Path) -> None:
    """The same bomb at the API's inspector: refused after a few MiB of output, not at the cap."""
    bomb = tmp_path / "bomb.json.gz"
    write_whitespace_bomb(bomb, 1024 * MiB)
    inspector = BodyInspector(gzipped=True, max_decompressed_bytes=8 << 30)
    with bomb.open("rb") as fh, pytest.raises(ApiError) as refused:
        while chunk := fh.read(64 * 1024):
            inspector.feed(chunk)
        inspector.finish()
    assert refused.value.status == 413 and refused.value.code == "implausible_compression"
    assert inspector.decompressed_bytes <= RATIO_CHECK_AFTER + 2 * MiB
    assert inspector.decompressed_bytes > MAX_COMPRESSION_RATIO * 1024  # it did look


def test_real_traces_pass_the_ratio_check(fixtures_dir: Path) -> None:
    path = fixtures_dir / "hta" / "df_index_resolver" / "df_index_resolver.json.gz"
    inspector = BodyInspector(gzipped=True, max_decompressed_bytes=8 << 30)
    with path.open("rb") as fh:
        while chunk := fh.read(64 * 1024):
            inspector.feed(chunk)
    inspector.finish()
    assert inspector.decompressed_bytes > RATIO_CHECK_AFTER
