"""The parser in parts: the argument table is the one place an ``args`` entry is declared.

Everything that names an argument (the typed and lax msgspec Structs, the lax coercion, each table's
record and column dtypes, the model's fields) is checked against ``schema.ARGS`` row by row, and a
row added here, test-locally, reaches a column with no other edit.
"""

from __future__ import annotations

import dataclasses
import math
from operator import attrgetter
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest

from stepdoctor_analysis import parsing
from stepdoctor_analysis.model.trace import NONE, GpuEvents, HostEvents, MemoryEvents
from stepdoctor_analysis.parsing import columns, reading, schema, splitting
from stepdoctor_analysis.parsing.schema import ARGS, Arg, args_struct, table

MODEL = {"host": HostEvents, "gpu": GpuEvents, "memory": MemoryEvents}
TABLES = {"host": schema.HOST, "gpu": schema.GPU, "memory": schema.MEMORY}


def _fields(struct: Any) -> dict[str, msgspec.structs.FieldInfo]:
    return {f.name: f for f in msgspec.structs.fields(struct)}


@pytest.mark.parametrize("arg", ARGS, ids=lambda a: a.attr)
def test_every_row_generates_both_decoders(arg: Arg) -> None:
    strict, lax = _fields(schema.Args)[arg.attr], _fields(schema.LaxArgs)[arg.attr]
    assert strict.encode_name == lax.encode_name == arg.key
    assert lax.type is Any and lax.default is None
    if arg.text == "value":  # a string arg (interned)
        typed = msgspec.json.decode(msgspec.json.encode({arg.key: "7"}), type=schema.Args)
        assert getattr(typed, arg.attr) == "7"
        assert strict.default is None and arg.coerce("7") == "7"
        assert arg.coerce(7) is None
        return
    if arg.text:  # a list of dtype strings, kept as its JSON text (its first floating one is read)
        value = ["int", "c10::BFloat16"]
        typed = msgspec.json.decode(msgspec.json.encode({arg.key: value}), type=schema.Args)
        text = getattr(typed, arg.attr)
        assert isinstance(text, msgspec.Raw) and schema.listed(bytes(text)) == tuple(value)
        assert strict.default == schema.NO_TEXT and arg.coerce(value) == text
        assert arg.coerce(7) == arg.coerce(None) == schema.NO_TEXT and arg.coerce(text) is text
        assert schema.first_floating(schema.listed(bytes(text))) == "c10::BFloat16"
        assert schema.listed(b'["long", 3, "float"]') == ("long", "float")  # odd items are skipped
        assert schema.listed(b'"float"') is schema.listed(b"null") is schema.listed(b"") is None
        return
    if arg.absent:
        assert strict.type is Any and strict.default == schema.ABSENT
    elif arg.is_float:
        assert strict.type is float and math.isnan(strict.default)
    else:
        assert strict.type is int and strict.default == NONE
    # The typed decoder reads the value from its JSON key; the lax path coerces a string to the same.
    typed = msgspec.json.decode(msgspec.json.encode({arg.key: 7}), type=schema.Args)
    assert getattr(typed, arg.attr) == 7
    loose = msgspec.convert({arg.key: "7"}, schema.LaxArgs)
    assert arg.coerce(getattr(loose, arg.attr)) == 7


def test_every_row_generates_its_columns_and_each_column_is_in_the_model() -> None:
    for name, tab in TABLES.items():
        every = [a for a in ARGS if getattr(a, name) is not None]
        mine = [a for a in every if not a.sparse]
        assert tab.args == tuple(mine) and tab.sparse == tuple(a for a in every if a.sparse)
        for a in tab.sparse:  # read apart, on the events that carry them: a column, not a record field
            assert a.attr not in (tab.record.names or ()) and tab.column(a) in tab.arg_columns
            assert tab.dtypes[tab.column(a)] == np.dtype(a.dtype)
        for a in mine:
            assert f"args.{a.attr}" in tab.fields
            assert tab.record.fields is not None and tab.record.fields[a.attr][0] == a.record_dtype
            assert tab.dtypes[tab.column(a)] == np.dtype(a.dtype)
        model_fields = {f.name for f in dataclasses.fields(MODEL[name])}
        assert set(tab.arg_columns) <= model_fields, f"{name}: an arg column the model lacks"
    assert {a.attr for a in ARGS} == set(_fields(schema.Args)) == set(_fields(schema.LaxArgs))
    assert {a.absent for a in ARGS if a.absent} <= set(columns.FALLBACKS)
    # Each event type decodes just the args its tables read (fewer fields: faster decoding).
    assert set(_fields(schema.CompleteArgs)) == {a.attr for a in ARGS if a.host or a.gpu}
    assert set(_fields(schema.InstantArgs)) == {a.attr for a in ARGS if a.memory}
    assert _fields(schema.Complete)["args"].type is schema.CompleteArgs
    assert _fields(schema.Instant)["args"].type is schema.InstantArgs


def test_a_new_kernel_argument_is_one_row() -> None:
    """A row added test-locally is decoded (typed and lax), read into the record and becomes a column."""
    rows = (*ARGS, Arg("registers", "registers per thread", "i4", gpu="registers"))
    typed, lax = args_struct(rows), args_struct(rows, lax=True)
    gpu = table("gpu", rows)
    assert "args.registers" in gpu.fields and gpu.dtypes["registers"] == np.int32
    assert "registers" in gpu.arg_columns

    decoded = msgspec.json.decode(b'{"registers per thread": 32, "correlation": 5, "stream": 7}', type=typed)
    coerced = msgspec.convert({"registers per thread": "0x10"}, lax)
    absent = typed()
    for a in rows:  # the slow path's coercion, as schema.tighten does it
        setattr(absent, a.attr, a.coerce(getattr(coerced, a.attr)))
    events = [
        SimpleNamespace(ts=1.0, dur=2.0, pid=0, tid=9, args=decoded),
        SimpleNamespace(ts=3.0, dur=1.0, pid=1, tid=9, args=absent),
    ]
    rec = np.fromiter(map(attrgetter(*gpu.fields, "pid", "tid"), events), gpu.record_ids, len(events))
    cols = columns.arg_columns(rec, gpu, rec["pid"], rec["tid"])
    assert cols["registers"].tolist() == [32, 16] and cols["registers"].dtype == np.int32
    assert cols["correlation"].tolist() == [5, NONE]
    assert cols["stream"].tolist() == [7, 9]  # a missing stream falls back to the event's tid


def test_a_second_spelling_fills_where_the_first_is_missing() -> None:
    host = schema.HOST
    ext = [a for a in host.args if host.column(a) == "external_id"]
    assert [a.key for a in ext] == ["External id", "external id"]
    rec = np.zeros(3, host.record)
    rec["external_id"] = [4, NONE, NONE]
    rec["external_id_legacy"] = [8, 6, NONE]
    pid = tid = np.zeros(3, np.int64)
    assert columns.arg_columns(rec, host, pid, tid)["external_id"].tolist() == [4, 6, NONE]


def test_every_event_but_a_complete_one_carries_its_type_code_where_a_category_would_be() -> None:
    """``columns.Builder`` classifies a chunk by one lookup of each event's ``cat``: a complete event's
    category (a string), any other event's type code (an int: no category can equal it)."""
    text = b'[{"ph":"X","cat":"kernel"},{"ph":"i"},{"ph":"I"},{"ph":"s","cat":"ac2g"},{"ph":"f"},{"ph":"t"},{"ph":"M"}]'
    full, lean = schema.EVENTS_DECODER.decode(text), schema.LEAN_DECODER.decode(text)
    assert [e.cat for e in full] == ["kernel", *[schema.INSTANT] * 2, -2, -3, -4, schema.SKIPPED_CODE]
    assert [e.cat for e in lean[3:6]] == [schema.FLOW_SKIPPED] * 3
    assert full[3].flow_cat == "ac2g"  # a flow's own category, read when flows repair correlations
    assert set(schema.TYPE_CODES) == {
        schema.INSTANT,
        schema.FLOW_START,
        schema.FLOW_END,
        schema.FLOW_STEP,
        schema.SKIPPED_CODE,
        schema.FLOW_SKIPPED,
    }
    assert all(code < 0 for code in schema.TYPE_CODES)  # kinds of complete events are >= 0


def test_an_attribute_clashing_with_an_event_field_is_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        table("gpu", (*ARGS, Arg("ts", "launch ts", "f8", gpu="launch_ts")))
    with pytest.raises(ValueError, match="unique"):
        table("host", (*ARGS, Arg("correlation", "Correlation", "i8", host="correlation")))


def test_the_parser_package_holds_no_tuning_knobs() -> None:
    """Knobs live where they are read, so a test patching ``parsing._CHUNK`` fails loudly instead of
    silently changing nothing."""
    assert parsing.DEFAULT_MAX_BYTES == reading.DEFAULT_MAX_BYTES
    for knob in ("_CHUNK", "_OUT_BLOCK", "_SMALL_FILE", "_inflate_lib", "_MAX_UNCUT"):
        assert not hasattr(parsing, knob)
    assert hasattr(splitting, "_CHUNK") and hasattr(splitting, "_MAX_UNCUT")
    assert hasattr(reading, "_OUT_BLOCK") and hasattr(reading, "_SMALL_FILE")


def _big_trace(bad_at: int, bad: bytes, n: int = 40_000) -> bytes:
    """A plain-JSON trace of ``n`` events (several 512 KB chunks), event ``bad_at`` edited."""
    events = [
        b'{"ph": "X", "cat": "cpu_op", "name": "aten::op%d", "pid": 1, "tid": 1, "ts": %d, "dur": 5}'
        % (i % 97, i * 10)
        for i in range(n)
    ]
    events[bad_at] = events[bad_at].replace(b'"ts": %d, "dur": 5' % (bad_at * 10), bad)
    return b'{"schemaVersion": 1, "traceEvents": [' + b", ".join(events) + b"]}"


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (b'"ts": 1e308, "dur": 5', "'ts' 1e+308 µs, out of range"),
        (b'"ts": -' + b"9" * 30 + b', "dur": 5', "'ts' -1e+30 µs, out of range"),
        (b'"ts": 300, "dur": 1e300', "'dur' 1e+300 µs, out of range"),
    ],
    ids=["ts-1e308", "ts-30-digits", "dur-1e300"],
)
def test_a_time_out_of_range_is_refused_naming_the_event_in_every_chunk(bad: bytes, says: str) -> None:
    """The fast (chunked) path checks the range, and the upload check (fed any block size) says the same."""
    import io

    from stepdoctor_analysis.errors import TraceError
    from stepdoctor_analysis.parsing.checking import TraceCheck

    text = _big_trace(31_234, bad)
    assert len(text) > 4 * splitting._CHUNK
    with pytest.raises(TraceError) as parsed:
        parsing.load_trace(io.BytesIO(text), name="trace")
    assert says in str(parsed.value) and "(event #31234)" in str(parsed.value)
    check = TraceCheck("trace")
    with pytest.raises(TraceError) as checked:
        for i in range(0, len(text), 65_537):
            check.feed(text[i : i + 65_537])
        check.finish()
    assert str(checked.value) == str(parsed.value)


def test_the_upload_check_passes_what_the_parser_reads(fixtures_dir: Any) -> None:
    """Real traces (gzip, several chunks) pass the check; an empty event list fails both alike."""
    import gzip

    from stepdoctor_analysis.errors import TraceError
    from stepdoctor_analysis.parsing.checking import TraceCheck

    path = fixtures_dir / "hta" / "trace_diff" / "control" / "control.json.gz"
    text = gzip.decompress(path.read_bytes())
    check = TraceCheck()
    for i in range(0, len(text), 1 << 20):
        check.feed(text[i : i + (1 << 20)])
    check.finish()
    empty = TraceCheck()
    empty.feed(b'{"traceEvents": [{"ph": "M", "name": "process_name"}]}')
    with pytest.raises(TraceError, match="contains no events"):
        empty.finish()


def test_the_upload_check_keeps_no_columns_between_chunks() -> None:
    """Bounded memory at upload: after each chunk every per-chunk list of the builder is empty,
    whatever lists the builder gains later (found by type, not by name)."""
    from stepdoctor_analysis.parsing.checking import TraceCheck

    text = _big_trace(5, b'"ts": 50, "dur": 5')
    check = TraceCheck()
    for i in range(0, len(text), 1 << 20):
        check.feed(text[i : i + (1 << 20)])
        builder = check._builder
        lists = {k: v for k, v in vars(builder).items() if isinstance(v, list)}
        assert lists and all(not v for v in lists.values()), {k: len(v) for k, v in lists.items()}
        assert all(not v for v in builder.sparse.values())
        assert builder.n_events > 0 or i == 0
    check.finish()


def test_to_int_gives_none_for_integers_beyond_64_bits() -> None:
    assert schema.to_int(2**63) == NONE and schema.to_int(-(2**63)) == -(2**63)
    assert schema.to_int("9" * 30) == NONE and schema.to_int(1e300) == NONE
    assert schema.to_int("0x10") == 16
