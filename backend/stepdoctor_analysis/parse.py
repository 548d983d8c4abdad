"""Kineto Chrome trace -> columnar ``RankTrace``, in bounded memory.

Traces of 1-2 GB are normal, so the file is never held as Python dicts: it is decompressed as a
stream, the ``traceEvents`` array is cut into chunks of about 512 KB at event boundaries, each
chunk is decoded in place by msgspec into small tagged Structs (only the fields we use; metadata,
other phases and, unless correlation ids are missing, flows decode to empty Structs), folded into numpy
columns, and dropped. A boundary is a ``}`` followed by ``,`` and ``{``; a wrong cut (inside a
string or a nested value) leaves the chunk unbalanced, so it fails to decode and an earlier
candidate is tried. Peak memory is the columns plus a few chunks, whatever the file size.

Every format generation of anchors §1 is accepted: fractional-µs Kineto, float ns-resolution, 2021
``Operator/Runtime/Kernel/Memcpy/Memset`` categories, ``ac2g``/``async_cpu_to_gpu``/``async``/
``launch`` flows (used to recover a missing correlation id), AMD ``hip*`` runtime calls, Triton's
``cuLaunchKernel`` (``cuda_driver``), CPU-only traces.
"""

from __future__ import annotations

import io
import os
import re
import zlib
from collections.abc import Callable, Generator, Iterator, Sequence
from operator import attrgetter, itemgetter
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO, Union

import msgspec
import numpy as np

from .errors import TraceError, TraceTooLarge
from .model import (
    NONE,
    CopyKind,
    DeviceInfo,
    GpuEvents,
    GpuKind,
    HostEvents,
    HostKind,
    HostMem,
    MemoryEvents,
    RankTrace,
)

_inflate_lib: ModuleType
try:  # ISA-L inflates gzip 2-2.5x faster than zlib (decompression is ~20% of a load), same API
    from isal import isal_zlib as _inflate_lib
except ImportError:  # the [analyze] extra installs it; zlib gives the same result, slower
    _inflate_lib = zlib
_INFLATE_ERRORS: tuple[type[Exception], ...] = (zlib.error, _inflate_lib.error)

DEFAULT_MAX_BYTES = 4 << 30
# Small pieces keep each chunk's text and Structs in cache and recycle the same heap blocks:
# 5-15% faster end to end on the fixtures than 2 MiB chunks of 4 MiB reads.
_READ_BLOCK = 1 << 20  # compressed bytes read at a time
_OUT_BLOCK = 256 << 10  # decompressed bytes produced at a time
# A file this small (most single-step traces) is read and inflated in one block of up to
# _SMALL_OUT_BLOCK: fewer buffers means less fresh memory to fault in, a sizeable part of a small load.
_SMALL_FILE = 256 << 10
_SMALL_OUT_BLOCK = 8 << 20
_CHUNK = 512 << 10  # event text decoded at a time (at least)
# Bounded memory whatever the text holds: more than this much text that cannot be cut into events
# (a giant string or value, deep nesting, a huge header or tail) is refused, not buffered.
_MAX_UNCUT = 64 << 20
# Once that much text waits uncut, whitespace runs are collapsed as blocks arrive, so a trace
# padded with gigabytes of whitespace costs memory for its events only. Only runs of 1 KiB+ are
# touched: outside strings JSON ignores them; inside one they could only be an absurd name.
_COLLAPSE_AFTER = 2 << 20
_LONG_WHITESPACE = re.compile(rb"[ \t\r\n]{1024,}")

# Category -> kind. Host kinds are 0..9, GPU kinds are offset by _GPU.
_GPU = 100
_CATEGORIES: dict[str, int] = {
    "cpu_op": HostKind.CPU_OP,
    "operator": HostKind.CPU_OP,
    "python": HostKind.CPU_OP,  # legacy autograd-profiler Python ops; tb-profiler counts them as CPU ops
    "user_annotation": HostKind.USER_ANNOTATION,
    "python_function": HostKind.PYTHON_FUNCTION,
    "cuda_runtime": HostKind.RUNTIME,
    "runtime": HostKind.RUNTIME,
    "hip_runtime": HostKind.RUNTIME,
    "cuda_driver": HostKind.DRIVER,
    "overhead": HostKind.OVERHEAD,
    "kernel": _GPU + GpuKind.KERNEL,
    "gpu_memcpy": _GPU + GpuKind.MEMCPY,
    "memcpy": _GPU + GpuKind.MEMCPY,
    "gpu_memset": _GPU + GpuKind.MEMSET,
    "memset": _GPU + GpuKind.MEMSET,
    "cuda_sync": _GPU + GpuKind.SYNC,
    "gpu_user_annotation": _GPU + GpuKind.ANNOTATION,
}
_FLOW_CATEGORIES = frozenset({"ac2g", "async_cpu_to_gpu", "async", "launch", "async_gpu"})
_LEGACY_CATEGORIES = frozenset({"Operator", "Runtime", "Kernel", "Memcpy", "Memset"})

_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_SPLIT_ANY = re.compile(rb"\}\s*,\s*\{")
# numpy compares against plain ints several times faster than against IntEnum members.
_RUNTIME, _DRIVER = int(HostKind.RUNTIME), int(HostKind.DRIVER)
_MEMCPY, _MEMSET = int(GpuKind.MEMCPY), int(GpuKind.MEMSET)
_ARRAY_END = re.compile(rb'\]\s*(?:,\s*"|\})')  # the events' ']' is followed by a key or the end


NAN = float("nan")
_ABSENT = -(2**62)  # stream/device arg missing (distinct from a real -1, e.g. "Event Sync" on stream -1)


class _Args(msgspec.Struct, gc=False):
    """The few ``args`` we read, typed so msgspec converts them in C (fast path)."""

    correlation: int = NONE
    external_id: int = msgspec.field(default=NONE, name="External id")
    external_id_legacy: int = msgspec.field(default=NONE, name="external id")
    device: Any = _ABSENT  # AMD traces write some streams as hex strings ("0x0")
    stream: Any = _ABSENT
    nbytes: int = msgspec.field(default=NONE, name="bytes")
    blocks_per_sm: float = msgspec.field(default=NAN, name="blocks per SM")
    occupancy: float = msgspec.field(default=NAN, name="est. achieved occupancy %")
    device_type: int = msgspec.field(default=NONE, name="Device Type")
    device_id: int = msgspec.field(default=NONE, name="Device Id")
    addr: int = msgspec.field(default=NONE, name="Addr")
    mem_bytes: int = msgspec.field(default=NONE, name="Bytes")
    total_allocated: int = msgspec.field(default=NONE, name="Total Allocated")
    total_reserved: int = msgspec.field(default=NONE, name="Total Reserved")


class _Complete(msgspec.Struct, tag_field="ph", tag="X", gc=False):
    """A duration event (``ph: X``): every host op, launch call and GPU op."""

    cat: str = ""
    name: str | None = None
    ts: float = NAN
    dur: float = NAN
    pid: int | str = NONE
    tid: int | str = NONE
    args: _Args = msgspec.field(default_factory=_Args)


class _Instant(msgspec.Struct, tag_field="ph", tag="i", gc=False):
    """An instant event: ``[memory]`` and ``[OutOfMemory]`` are the ones we keep."""

    name: str | None = None
    ts: float = NAN
    args: _Args = msgspec.field(default_factory=_Args)


class _InstantLegacy(_Instant, tag="I"):
    pass


class _FlowStart(msgspec.Struct, tag_field="ph", tag="s", gc=False):
    """Flow endpoints: only needed to recover correlation ids in traces that lack them."""

    cat: str = ""
    id: int | str | None = None
    ts: float = NAN
    pid: int | str = NONE
    tid: int | str = NONE


class _FlowEnd(_FlowStart, tag="f"):
    pass


class _FlowStep(_FlowStart, tag="t"):
    pass


# Every other Chrome trace phase decodes into an empty Struct: parsed, never materialised.
_SKIPPED = tuple(
    msgspec.defstruct(f"_Skip{i}", [], tag_field="ph", tag=ph, gc=False)
    for i, ph in enumerate(
        ("M", "B", "E", "C", "b", "n", "e", "P", "N", "O", "D", "V", "v", "R", "c", "(", ")")
    )
)
_Event = Any  # one of the tagged Structs above
_TYPE_CODES: dict[type, int] = {
    _Complete: 0,
    _Instant: 1,
    _InstantLegacy: 1,
    _FlowStart: 2,
    _FlowEnd: 3,
    _FlowStep: 4,
}
_TYPE_CODES.update(dict.fromkeys(_SKIPPED, 5))
_EventUnion = Union[(_Complete, _Instant, _InstantLegacy, _FlowStart, _FlowEnd, _FlowStep, *_SKIPPED)]  # type: ignore[valid-type]
# Flow events are a third of a modern trace but only matter when correlation ids are missing (old
# traces): the lean decoder skips them (type code 6); a chunk that turns out to need them is decoded
# again in full, and so is the rest of that trace.
_FLOWS_SKIPPED = tuple(
    msgspec.defstruct(f"_SkipFlow{i}", [], tag_field="ph", tag=ph, gc=False) for i, ph in enumerate("sft")
)
_TYPE_CODES.update(dict.fromkeys(_FLOWS_SKIPPED, 6))
_LeanUnion = Union[(_Complete, _Instant, _InstantLegacy, *_FLOWS_SKIPPED, *_SKIPPED)]  # type: ignore[valid-type]


class _LaxArgs(msgspec.Struct, gc=False):
    """Same fields, untyped: for producers that write odd values (null, strings, lists)."""

    correlation: Any = None
    external_id: Any = msgspec.field(default=None, name="External id")
    external_id_legacy: Any = msgspec.field(default=None, name="external id")
    device: Any = None
    stream: Any = None
    nbytes: Any = msgspec.field(default=None, name="bytes")
    blocks_per_sm: Any = msgspec.field(default=None, name="blocks per SM")
    occupancy: Any = msgspec.field(default=None, name="est. achieved occupancy %")
    device_type: Any = msgspec.field(default=None, name="Device Type")
    device_id: Any = msgspec.field(default=None, name="Device Id")
    addr: Any = msgspec.field(default=None, name="Addr")
    mem_bytes: Any = msgspec.field(default=None, name="Bytes")
    total_allocated: Any = msgspec.field(default=None, name="Total Allocated")
    total_reserved: Any = msgspec.field(default=None, name="Total Reserved")


class _LaxEvent(msgspec.Struct, gc=False):
    ph: Any = ""
    cat: Any = ""
    name: Any = None
    ts: Any = None
    dur: Any = None
    pid: Any = None
    tid: Any = None
    id: Any = None
    args: Any = None


_EVENTS_DECODER = msgspec.json.Decoder(list[_EventUnion])
_LEAN_DECODER = msgspec.json.Decoder(list[_LeanUnion])
_LAX_DECODER = msgspec.json.Decoder(list[_LaxEvent], strict=False)
_INT_ARGS = (
    "correlation",
    "external_id",
    "external_id_legacy",
    "device",
    "stream",
    "nbytes",
    "device_type",
    "device_id",
    "addr",
    "mem_bytes",
    "total_allocated",
    "total_reserved",
)


def _tighten(events: list[_LaxEvent]) -> list[_Event]:
    """Coerce untyped events into the typed form, value by value (slow path, rare)."""
    out: list[_Event] = []
    for e in events:
        ph = e.ph if isinstance(e.ph, str) else ""
        a = e.args
        args = _Args()
        if isinstance(a, dict):
            lax = msgspec.convert(a, _LaxArgs, strict=False)
            for f in _INT_ARGS:
                v = getattr(lax, f)
                setattr(args, f, _ABSENT if v is None and f in ("device", "stream") else _int(v))
            args.blocks_per_sm = _float(lax.blocks_per_sm)
            args.occupancy = _float(lax.occupancy)
        name = None if e.name is None else str(e.name)
        ts = _float(e.ts) if e.ts is not None else NAN
        pid = e.pid if isinstance(e.pid, (int, str)) and not isinstance(e.pid, bool) else NONE
        tid = e.tid if isinstance(e.tid, (int, str)) and not isinstance(e.tid, bool) else NONE
        cat = e.cat if isinstance(e.cat, str) else ""
        if ph == "X":
            dur = _float(e.dur) if e.dur is not None else NAN
            out.append(_Complete(cat=cat, name=name, ts=ts, dur=dur, pid=pid, tid=tid, args=args))
        elif ph in ("i", "I"):
            out.append(_Instant(name=name, ts=ts, args=args))
        elif ph in ("s", "f", "t"):
            flow_id = e.id if isinstance(e.id, (int, str)) and not isinstance(e.id, bool) else None
            cls = {"s": _FlowStart, "f": _FlowEnd, "t": _FlowStep}[ph]
            out.append(cls(cat=cat, id=flow_id, ts=ts, pid=pid, tid=tid))
        else:
            out.append(_SKIPPED[0]())
    return out


def load_trace(
    path: str | Path | BinaryIO, *, max_bytes: int | None = None, name: str | None = None
) -> RankTrace:
    """Parse one rank's trace (``.json`` or gzip, detected by content) into a ``RankTrace``.

    ``path`` may also be a readable binary stream (an object-store reader), read once front to
    back, so a server worker needs no local copy; ``name`` labels it in messages.
    """
    cap = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    if isinstance(path, str | Path):
        p = Path(path)
        if not p.is_file():
            raise TraceError(f"{p.name}: no such trace file")
        source: Path | BinaryIO = p
        builder, label = _Builder(str(p)), p.name
    else:
        source = path
        label = name or Path(str(getattr(path, "name", "") or "trace")).name
        builder = _Builder(label)
    # Decompression runs inline: a producer thread lost more to GIL hand-offs than it overlapped
    # (measured 8-20% slower, from 2 MB to 800 MB traces, on 2 cores).
    blocks = _decompressed_blocks(source, cap, label)
    try:
        _StreamParser(builder, label).run(blocks)
    except RecursionError:  # msgspec recurses per nesting level
        raise TraceError(f"{label}: JSON nested too deeply to be a trace") from None
    finally:
        blocks.close()  # closes the file at once, also when parsing failed
    return builder.finish()


def load_job(path: str | Path, *, max_bytes: int | None = None) -> list[RankTrace]:
    """Parse a file, or a directory of per-rank ``.json``/``.json.gz`` files, sorted by rank."""
    p = Path(path)
    if p.is_file():
        return [load_trace(p, max_bytes=max_bytes)]
    if not p.is_dir():
        raise TraceError(f"{p.name}: no such trace file or directory")
    files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith((".json", ".json.gz")))
    if not files:
        raise TraceError(f"{p.name}: directory holds no .json or .json.gz trace files")
    traces = [load_trace(f, max_bytes=max_bytes) for f in files]
    # Rank from distributedInfo; traces without one keep their file order after ranked ones.
    order = sorted(range(len(traces)), key=lambda i: (traces[i].rank is None, traces[i].rank or 0, i))
    return [traces[i] for i in order]


# --------------------------------------------------------------------------- reading


def _decompressed_blocks(p: Path | BinaryIO, cap: int, name: str) -> Generator[bytes, None, None]:
    """Yield the file's decompressed bytes in blocks; gzip is detected by its magic number."""
    produced = 0
    with p.open("rb") if isinstance(p, Path) else io.BufferedReader(_RawStream(p)) as fh:
        head = fh.peek(2)[:2]
        small = _size(fh, p) <= _SMALL_FILE
        out_block = _SMALL_OUT_BLOCK if small else _OUT_BLOCK
        if head != b"\x1f\x8b":
            while block := fh.read(out_block):
                produced += len(block)
                if produced > cap:
                    raise _too_large(name, cap)
                yield block
            return
        d = _inflate_lib.decompressobj(zlib.MAX_WBITS | 16)
        at_boundary = True  # no gzip member is half-read
        while data := fh.read(_READ_BLOCK):
            while data:
                at_boundary = False
                out = _inflate(d, data, name, out_block)
                produced += len(out)
                if produced > cap:
                    raise _too_large(name, cap)
                if out:
                    yield out
                if d.eof:
                    # Concatenated gzip members are legal; trailing zero padding is not a member.
                    data = d.unused_data if d.unused_data.strip(b"\x00") else b""
                    d = _inflate_lib.decompressobj(zlib.MAX_WBITS | 16)
                    at_boundary = True
                else:
                    data = d.unconsumed_tail
        while not at_boundary and not d.eof and (out := _inflate(d, b"", name, out_block)):
            produced += len(out)
            if produced > cap:
                raise _too_large(name, cap)
            yield out
        if not at_boundary and not d.eof:
            raise TraceError(f"{name}: truncated gzip data (the file ends mid-stream)")


class _RawStream(io.RawIOBase):
    """A caller's binary stream (whose ``read`` may return any buffer) as raw I/O we can buffer."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = memoryview(self._stream.read(len(buffer))).cast("B")
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._stream.close()
        super().close()


def _size(fh: BinaryIO, source: Path | BinaryIO) -> float:
    """Bytes in the file (a stream's ``size`` if it tells; unknown counts as large)."""
    try:
        return os.fstat(fh.fileno()).st_size
    except (OSError, AttributeError):
        size = getattr(source, "size", None)
        return float(size) if isinstance(size, int) else float("inf")


def _inflate(d: Any, data: bytes, name: str, out_block: int) -> bytes:
    try:
        return bytes(d.decompress(data, out_block))
    except _INFLATE_ERRORS as exc:
        raise TraceError(f"{name}: corrupt gzip data ({exc})") from None


def _too_large(name: str, cap: int) -> TraceTooLarge:
    return TraceTooLarge(
        f"{name}: decompressed trace exceeds the {cap:,} byte limit ({cap / 2**20:.0f} MiB); "
        "raise max_bytes if this trace is genuine"
    )


# --------------------------------------------------------------------------- splitting


class _StreamParser:
    """Cuts the decompressed text into header, event chunks and tail."""

    def __init__(self, builder: _Builder, name: str) -> None:
        self.b = builder
        self.name = name
        self.buf = bytearray()
        self.header: bytes | None = None
        self.key = b""  # the '"traceEvents":' text cut from between header and events
        self.whole = False  # give up cutting: decode everything at the end
        self.failed_at = 0  # buffer size at the last failed cut
        self.decoder = _LEAN_DECODER  # switched to _EVENTS_DECODER once flows turn out to be needed
        self.searched = 0  # the header search resumes here (no rescanning: linear time)

    def run(self, blocks: Iterator[bytes]) -> None:
        for block in blocks:
            if len(self.buf) > _COLLAPSE_AFTER:
                block = b" " if not block.strip() else _LONG_WHITESPACE.sub(b" ", block)
            self.buf += block
            if len(self.buf) > _MAX_UNCUT:
                raise TraceError(
                    f"{self.name}: more than {_MAX_UNCUT >> 20} MiB of text that is not a sequence of "
                    "trace events (a giant string or value, or nesting too deep); refusing it"
                )
            if self.header is None and not self.whole:
                self._find_header()
            if self.header is not None and not self.whole and len(self.buf) >= _CHUNK:
                self._cut_chunks()
        self._finish()

    def _find_header(self) -> None:
        m = _EVENTS_KEY.search(self.buf, self.searched)
        if m is None:
            self.searched = max(0, len(self.buf) - 64)  # the key may straddle two blocks
            return
        header = bytes(self.buf[: m.start()])
        try:
            msgspec.json.decode(header + b'"_": 0}')
        except msgspec.DecodeError:
            self.whole = True  # the key sat somewhere odd; let the full decoder judge
            return
        self.header = header
        self.key = bytes(self.buf[m.start() : m.end() - 1])
        # Keep the array's '[': the buffer always starts with '[' so chunks decode in place.
        del self.buf[: m.end() - 1]

    def _cut_chunks(self) -> None:
        """Decode all whole events buffered so far, in place (no copy of the text)."""
        if len(self.buf) <= self.failed_at:
            return
        for cut in self._split_candidates(len(self.buf)):
            comma = self.buf.index(b",", cut + 1)
            saved = self.buf[cut + 1]
            self.buf[cut + 1] = 0x5D  # ']' closes the chunk; the bytes up to the comma are dropped after
            with memoryview(self.buf) as view:
                events = self._decode_events(view[: cut + 2])
            if events is None:
                self.buf[cut + 1] = saved
                continue
            self.b.absorb(events)
            del events
            if self.b.flows_skipped:
                with memoryview(self.buf) as view:
                    self._absorb_flows(view[: cut + 2])
            del self.buf[:comma]
            self.buf[0] = 0x5B  # '['
            self.failed_at = 0
            return
        self._note_failure()

    def _note_failure(self) -> None:
        """No cut worked (a giant event, or odd nesting): wait for more text (up to _MAX_UNCUT)."""
        self.failed_at = len(self.buf) + _CHUNK

    def _split_candidates(self, before: int, tries: int = 3) -> Iterator[int]:
        """Up to ``tries`` positions of a ``}`` followed by ``,`` and ``{``, latest first.

        A cut inside a string or a nested value makes the chunk fail to decode (unbalanced or
        unterminated), so the caller then tries the next candidate.
        """
        pos, found, lo = before, 0, max(1, before - _CHUNK)
        while found < tries:
            pos = self.buf.rfind(b"}", lo, pos)
            if pos < 0:
                return
            if _SPLIT_ANY.match(self.buf, pos):
                found += 1
                yield pos

    def _absorb_flows(self, data: memoryview) -> None:
        """The chunk just absorbed needs its flow events: decode it in full, and the rest of the trace."""
        self.decoder = _EVENTS_DECODER
        events = self._decode_events(data)
        self.b.flows_skipped = False
        if events is not None:
            self.b.absorb_flows(events)

    def _decode_events(self, data: bytes | memoryview) -> list[_Event] | None:
        """Decode ``[ ... ]`` holding whole events; None when the text is not a whole number of events."""
        try:
            return self.decoder.decode(data)
        except msgspec.DecodeError as exc:
            if not isinstance(exc, msgspec.ValidationError):
                return None
        try:
            return _tighten(_LAX_DECODER.decode(data))
        except msgspec.ValidationError as exc:
            raise TraceError(f"{self.name}: malformed event ({_short(exc)})") from None
        except msgspec.DecodeError:
            return None

    def _finish(self) -> None:
        if self.header is None:
            self._decode_whole(bytes(self.buf))
            return
        rest, self.buf = self.buf, bytearray()  # take the text over: a copy is fresh memory to fault in
        # The events array ends at one of the last ']'; the tail after it must close the object.
        # Only a ']' followed by another key or the closing '}' can end it: Kineto's "logs" array after
        # the events holds many "cpp:983] ..." lines, each a ']' skipped here without decoding.
        pos, tries = len(rest), 0
        while tries < 64:
            pos = rest.rfind(b"]", 0, pos)
            if pos < 0:
                break
            if not _ARRAY_END.match(rest, pos):
                continue
            tries += 1
            tail = rest[pos + 1 :].strip().lstrip(b",").strip()
            try:
                msgspec.json.decode(b"{" + tail if tail != b"}" else b"{}")  # cheap: no header
                top = msgspec.json.decode(self.header + (tail if tail != b"}" else b'"_": 0}'))
            except msgspec.DecodeError:
                continue
            with memoryview(rest) as view:
                events = self._decode_events(view[: pos + 1])
            if events is None:
                continue
            self.b.absorb(events)
            if self.b.flows_skipped:
                with memoryview(rest) as view:
                    self._absorb_flows(view[: pos + 1])
            self.b.set_top(top if isinstance(top, dict) else {})
            return
        # No clean end: let the decoder name the problem.
        raise TraceError(f"{self.name}: not valid JSON ({_json_error(self.header + self.key + rest)})")

    def _decode_whole(self, text: bytes) -> None:
        try:
            top = msgspec.json.decode(text, type=dict[str, Any])
        except msgspec.ValidationError:
            raise TraceError(f"{self.name}: not a Chrome trace (top level is not a JSON object)") from None
        except msgspec.DecodeError as exc:
            raise TraceError(f"{self.name}: not valid JSON ({_short(exc)})") from None
        raw = top.pop("traceEvents", None)
        if not isinstance(raw, list):
            raise TraceError(f"{self.name}: no 'traceEvents' list; not a Chrome/Kineto trace")
        try:
            events = _tighten(msgspec.convert(raw, type=list[_LaxEvent], strict=False))
        except msgspec.ValidationError as exc:
            raise TraceError(f"{self.name}: malformed event ({_short(exc)})") from None
        del raw
        self.b.absorb(events)
        self.b.set_top(top)


def _json_error(text: bytes) -> str:
    try:
        msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        return _short(exc)
    return "unexpected structure"


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0][:200]


# --------------------------------------------------------------------------- columns


def _int(v: Any) -> int:
    """Best-effort integer for an untyped arg value; NONE when absent or unusable."""
    if type(v) is int:
        return v
    if v is None or isinstance(v, bool):
        return NONE
    if isinstance(v, float):
        return int(v) if v == v else NONE
    if isinstance(v, str):
        try:
            return int(v, 0) if v[:2].lower() == "0x" else int(float(v))
        except ValueError:
            return NONE
    return NONE


def _float(v: Any) -> float:
    if type(v) is float or type(v) is int:
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return float("nan")
    return float("nan")


class _Interner(dict[str, int]):
    """Name -> dense id; ``__getitem__`` stays in C for names already seen."""

    def __missing__(self, key: str) -> int:
        v = self[key] = len(self)
        return v


class _Codes(dict[str, int]):
    """Category of a complete event -> host kind or ``_GPU`` + GPU kind, once per distinct category."""

    def __missing__(self, cat: str) -> int:
        code = _CATEGORIES.get(cat)
        v = self[cat] = int(code if code is not None else _CATEGORIES.get(cat.lower(), HostKind.OTHER))
        return v


def _pick(events: Sequence[_Event], idx: np.ndarray) -> Sequence[_Event]:
    """The events at ``idx``, gathered in C."""
    if idx.size == 1:
        return [events[int(idx[0])]]
    return itemgetter(*idx.tolist())(events)


_CAT = attrgetter("cat")
_NAME = attrgetter("name")
_TS = attrgetter("ts")
_ID = attrgetter("id")
_DUR = attrgetter("dur")
_PID = attrgetter("pid")
_TID = attrgetter("tid")
_HOST_NAMES = ("ts", "dur", "args.correlation", "args.external_id", "args.external_id_legacy")
_HOST_RECORD = np.dtype(
    [
        ("ts", "f8"),
        ("dur", "f8"),
        ("correlation", "i8"),
        ("external_id", "i8"),
        ("external_id_legacy", "i8"),
    ]
)
_GPU_NAMES = (
    "ts", "dur", "args.device", "args.stream", "args.correlation", "args.nbytes", "args.blocks_per_sm",
    "args.occupancy",
)  # fmt: skip
_GPU_RECORD = np.dtype(
    [
        ("ts", "f8"),
        ("dur", "f8"),
        ("device", "i8"),
        ("stream", "i8"),
        ("correlation", "i8"),
        ("bytes", "i8"),
        ("blocks_per_sm", "f4"),
        ("occupancy", "f4"),
    ]
)
_IDS = (("pid", "i8"), ("tid", "i8"))


def _with_ids(record: np.dtype[Any]) -> np.dtype[Any]:
    fields: dict[str, Any] = dict(record.fields or {})
    return np.dtype([(k, fields[k][0]) for k in record.names or ()] + list(_IDS))


_HOST_RECORD_IDS = _with_ids(_HOST_RECORD)
_GPU_RECORD_IDS = _with_ids(_GPU_RECORD)


_MEM_FIELDS = attrgetter(
    "ts",
    "args.device_type",
    "args.device_id",
    "args.addr",
    "args.mem_bytes",
    "args.total_allocated",
    "args.total_reserved",
)
_MEM_RECORD = np.dtype(
    [
        ("ts", "f8"),
        ("device_type", "i1"),
        ("device_id", "i4"),
        ("addr", "i8"),
        ("bytes", "i8"),
        ("total_allocated", "i8"),
        ("total_reserved", "i8"),
    ]
)


class _Builder:
    """Accumulates per-chunk numpy columns and assembles the RankTrace."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.ids: dict[str, int] = _Interner()
        self.codes: dict[str, int] = _Codes()
        self.host: list[dict[str, np.ndarray]] = []
        self.gpu: list[dict[str, np.ndarray]] = []
        self.mem: list[dict[str, np.ndarray]] = []
        self.flows: list[dict[str, np.ndarray]] = []  # flow endpoints, to repair missing correlations
        self.oom = 0
        self.n_events = 0
        self.top: dict[str, Any] = {}
        self.labels: dict[Any, int] = {}  # string pid/tid -> negative id
        self.flows_skipped = False  # the last chunk needs flow events its lean decoding skipped

    def _label(self, v: Any) -> int:
        """Stable negative id for a non-integer pid/tid label."""
        if type(v) is int:
            return v
        got = self.labels.get(v)
        if got is None:
            got = self.labels[v] = -2 - len(self.labels)
        return got

    def absorb(self, events: list[_Event]) -> None:
        """Fold one decoded chunk into numpy columns (C-level ``map``/``attrgetter`` loops)."""
        n = len(events)
        if n == 0:
            return
        first = self.n_events
        self.n_events += n
        types = np.fromiter(map(_TYPE_CODES.__getitem__, map(type, events)), np.int8, n)
        host_before, gpu_before = len(self.host), len(self.gpu)
        complete = np.flatnonzero(types == 0)
        if complete.size:
            evs = _pick(events, complete)
            codes = np.fromiter(map(self.codes.__getitem__, map(_CAT, evs)), np.int16, len(evs))
            on_gpu = codes >= _GPU
            for mask, add_to, offset, build in (
                (~on_gpu, self.host, 0, self._host_columns),
                (on_gpu, self.gpu, _GPU, self._gpu_columns),
            ):
                idx = np.flatnonzero(mask)
                if idx.size:
                    cols = build(_pick(evs, idx), codes[idx] - offset)
                    self._check(cols, first + complete[idx])
                    add_to.append(cols)
        instants = np.flatnonzero(types == 1)
        if instants.size:
            self._instants(_pick(events, instants))
        flows = np.flatnonzero((types >= 2) & (types <= 6) & (types != 5))
        if flows.size and self._needs_flows(len(self.host) - host_before, len(self.gpu) - gpu_before):
            if (types[flows] == 6).any():
                self.flows_skipped = True  # the parser decodes this chunk again and calls absorb_flows
            else:
                self._flows(_pick(events, flows), types[flows])

    def absorb_flows(self, events: list[_Event]) -> None:
        """The flow events of a chunk already absorbed (decoded again, in full)."""
        types = np.fromiter(map(_TYPE_CODES.__getitem__, map(type, events)), np.int8, len(events))
        flows = np.flatnonzero((types >= 2) & (types <= 4))
        if flows.size:
            self._flows(_pick(events, flows), types[flows])

    def _needs_flows(self, new_host: int, new_gpu: int) -> bool:
        """Flows only matter where launch calls or GPU ops of this chunk lack a correlation id."""
        for cols in self.host[len(self.host) - new_host :]:
            launch = (cols["kind"] == _RUNTIME) | (cols["kind"] == _DRIVER)
            if (cols["correlation"][launch] == NONE).any():
                return True
        for cols in self.gpu[len(self.gpu) - new_gpu :]:
            ops = cols["kind"] <= _MEMSET
            if (cols["correlation"][ops] == NONE).any():
                return True
        return False

    def _instants(self, evs: Sequence[_Event]) -> None:
        """``[memory]`` instants become rows; ``[OutOfMemory]`` ones are counted; others ignored."""
        names = list(map(_NAME, evs))
        self.oom += names.count("[OutOfMemory]")
        is_mem = np.fromiter(map("[memory]".__eq__, names), np.bool_, len(names))
        if is_mem.any():
            cols = self._mem_columns(_pick(evs, np.flatnonzero(is_mem)))
            if np.isnan(cols["ts"]).any():
                raise TraceError(f"{Path(self.source).name}: a [memory] event lacks 'ts'")
            self.mem.append(cols)

    def _flows(self, evs: Sequence[_Event], types: np.ndarray) -> None:
        keep = np.flatnonzero(
            np.fromiter(map(_FLOW_CATEGORIES.__contains__, map(_CAT, evs)), np.bool_, len(evs))
        )
        if keep.size == 0:
            return
        kept = _pick(evs, keep)
        self.flows.append(
            {
                "id": self._ids(kept, _ID),
                "start": types[keep] == 2,
                "pid": self._ids(kept, _PID),
                "tid": self._ids(kept, _TID),
                "ts": np.fromiter(map(_TS, kept), np.float64, len(kept)),
            }
        )

    def _check(self, cols: dict[str, np.ndarray], positions: np.ndarray) -> None:
        """Complete events need name, ts and dur; say which event lacks what."""
        bad_ts, bad_dur = np.isnan(cols["ts"]), np.isnan(cols["dur"])
        bad_name = cols["name"] == self.ids.get(None, -1)  # type: ignore[call-overload]
        bad = bad_ts | bad_dur | bad_name
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            missing = "ts" if bad_ts[i] else "dur" if bad_dur[i] else "name"
            raise TraceError(
                f"{Path(self.source).name}: a complete ('X') event lacks '{missing}' (event #{int(positions[i])})"
            )

    def _names(self, evs: Sequence[_Event]) -> np.ndarray:
        return np.fromiter(map(self.ids.__getitem__, map(_NAME, evs)), np.int32, len(evs))

    def _ids(
        self, evs: Sequence[_Event], getter: Callable[[_Event], Any], labelled: bool = False
    ) -> np.ndarray:
        """pid/tid column; string labels (``"Spans"``) get stable negative ids.

        ``labelled``: the caller knows a label is among them, so skip the all-integer attempt.
        """
        n = len(evs)
        if not labelled:
            try:
                return np.fromiter(map(getter, evs), np.int64, n)
            except (TypeError, ValueError):
                pass
        vals = list(map(getter, evs))
        for v in set(vals):
            if v.__class__ is not int:
                self._label(v)
        return np.fromiter(map(self.labels.get, vals, vals), np.int64, n)

    def _records(
        self, evs: Sequence[_Event], fields: tuple[str, ...], record: np.dtype[Any], with_ids: np.dtype[Any]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The numeric columns named by ``fields``/``record``, then pid and tid (``with_ids`` adds them).

        One structured ``fromiter`` (pid and tid included) is ~2x faster than one per field. Label
        pids/tids (``"Spans"``) break it, so they are read apart: once one was seen (labels recur in
        every chunk), and when the chunk's last event has one (Kineto writes its ``"Spans"`` span
        last, so a failed attempt would have cost a whole pass). A chunk holding another odd value
        (a hex-string stream) is redone field by field, coercing.
        """
        n = len(evs)
        last = evs[-1]
        labelled = last.pid.__class__ is not int or last.tid.__class__ is not int
        if not self.labels and not labelled:
            try:
                cols = np.fromiter(map(attrgetter(*fields, "pid", "tid"), evs), with_ids, n)
                return cols, cols["pid"], cols["tid"]
            except (TypeError, ValueError, OverflowError):
                pass
        pid, tid = self._ids(evs, _PID, labelled), self._ids(evs, _TID, labelled)
        try:
            return np.fromiter(map(attrgetter(*fields), evs), record, n), pid, tid
        except (TypeError, ValueError, OverflowError):
            pass
        out: dict[str, np.ndarray] = {}
        for field, col in zip(fields, record.names or (), strict=True):
            get = attrgetter(field)
            dtype = record.fields[col][0] if record.fields else np.dtype(np.int64)
            try:
                out[col] = np.fromiter(map(get, evs), dtype, n)
            except (TypeError, ValueError, OverflowError):
                conv = _float if dtype.kind == "f" else _int
                out[col] = np.fromiter((conv(get(e)) for e in evs), dtype, n)
        return out, pid, tid  # type: ignore[return-value]

    def _host_columns(self, evs: Sequence[_Event], kinds: np.ndarray) -> dict[str, np.ndarray]:
        cols, pid, tid = self._records(evs, _HOST_NAMES, _HOST_RECORD, _HOST_RECORD_IDS)
        ext = cols["external_id"]
        if (ext == NONE).any():
            ext = np.where(ext == NONE, cols["external_id_legacy"], ext)
        return {
            "name": self._names(evs),
            "kind": kinds.astype(np.int8),
            "ts": cols["ts"],
            "dur": cols["dur"],
            "pid": pid,
            "tid": tid,
            "correlation": cols["correlation"],
            "external_id": ext,
        }

    def _gpu_columns(self, evs: Sequence[_Event], kinds: np.ndarray) -> dict[str, np.ndarray]:
        cols, pid, tid = self._records(evs, _GPU_NAMES, _GPU_RECORD, _GPU_RECORD_IDS)
        device = cols["device"]
        device = np.where(device == _ABSENT, np.where(pid >= 0, pid, NONE), device)
        stream = np.where(cols["stream"] == _ABSENT, tid, cols["stream"])
        return {
            "name": self._names(evs),
            "kind": kinds.astype(np.int8),
            "ts": cols["ts"],
            "dur": cols["dur"],
            "device": device.astype(np.int32),
            "stream": stream,
            "pid": pid,
            "tid": tid,
            "correlation": cols["correlation"],
            "bytes": cols["bytes"],
            "blocks_per_sm": cols["blocks_per_sm"],
            "occupancy": cols["occupancy"],
        }

    def _mem_columns(self, evs: Sequence[_Event]) -> dict[str, np.ndarray]:
        cols = np.fromiter(map(_MEM_FIELDS, evs), _MEM_RECORD, len(evs))
        return {k: np.ascontiguousarray(cols[k]) for k in _MEM_DTYPES}

    def set_top(self, top: dict[str, Any]) -> None:
        self.top = top

    # ------------------------------------------------------------------ assembly

    def finish(self) -> RankTrace:
        if not self.host and not self.gpu and not self.mem:
            raise TraceError(f"{Path(self.source).name}: the trace contains no events")
        host = _concat(self.host, _HOST_DTYPES)
        gpu = _concat(self.gpu, _GPU_DTYPES)
        mem = _concat(self.mem, _MEM_DTYPES)
        origin = _origin(host["ts"], gpu["ts"], mem["ts"])
        host_ts, gpu_ts, mem_ts = (_to_ns(a, origin) for a in (host["ts"], gpu["ts"], mem["ts"]))
        host_dur, gpu_dur = (
            np.maximum(np.rint(a * 1000.0), 0).astype(np.int64) for a in (host["dur"], gpu["dur"])
        )
        strings = list(self.ids)
        if self.flows:
            self._repair_correlation(host, host_ts, gpu, gpu_ts, origin)
        ho = np.argsort(host_ts, kind="stable")
        go = np.argsort(gpu_ts, kind="stable")
        mo = np.argsort(mem_ts, kind="stable")
        copy_table, mem_table = _copy_tables(strings)
        gname = gpu["name"][go]
        gkind = gpu["kind"][go]
        is_copy = gkind == _MEMCPY
        host_events = HostEvents(
            name=host["name"][ho],
            kind=host["kind"][ho],
            ts=host_ts[ho],
            dur=host_dur[ho],
            pid=host["pid"][ho],
            tid=host["tid"][ho],
            correlation=host["correlation"][ho],
            external_id=host["external_id"][ho],
        )
        gpu_events = GpuEvents(
            name=gname,
            kind=gkind,
            ts=gpu_ts[go],
            dur=gpu_dur[go],
            device=gpu["device"][go],
            stream=gpu["stream"][go],
            correlation=gpu["correlation"][go],
            bytes=gpu["bytes"][go],
            copy_kind=np.where(is_copy, copy_table[gname], np.int8(CopyKind.NONE)),
            host_mem=np.where(is_copy, mem_table[gname], np.int8(HostMem.NONE)),
            blocks_per_sm=gpu["blocks_per_sm"][go],
            occupancy=gpu["occupancy"][go],
        )
        memory = MemoryEvents(
            ts=mem_ts[mo],
            device_type=mem["device_type"][mo],
            device_id=mem["device_id"][mo],
            addr=mem["addr"][mo],
            bytes=mem["bytes"][mo],
            total_allocated=mem["total_allocated"][mo],
            total_reserved=mem["total_reserved"][mo],
        )
        top = self.top
        dist = top.get("distributedInfo")
        dist = dist if isinstance(dist, dict) else {}
        rank = _int(dist.get("rank"))
        world = _int(dist.get("world_size"))
        return RankTrace(
            source=self.source,
            strings=strings,
            host=host_events,
            gpu=gpu_events,
            memory=memory,
            devices=_devices(top.get("deviceProperties")),
            rank=rank if rank != NONE else None,
            world_size=world if world != NONE else None,
            out_of_memory=self.oom,
            format="legacy-2021" if any(c in self.codes for c in _LEGACY_CATEGORIES) else "kineto",
            metadata={
                k: v for k, v in top.items() if k not in ("deviceProperties", "distributedInfo") and _small(v)
            },
            distributed=dist,
        )

    def _repair_correlation(
        self,
        host: dict[str, np.ndarray],
        host_ts: np.ndarray,
        gpu: dict[str, np.ndarray],
        gpu_ts: np.ndarray,
        origin: int,
    ) -> None:
        """Old traces link launches to GPU ops only by flow events: turn flow ids into correlations.

        A flow start binds to the host slice on its thread beginning at its timestamp, a flow end to
        the GPU slice on its (pid, tid) beginning at its timestamp (Chrome's ``bp: e`` binding).
        """
        need_h = np.flatnonzero(
            (host["correlation"] == NONE) & np.isin(host["kind"], (HostKind.RUNTIME, HostKind.DRIVER))
        )
        need_g = np.flatnonzero(gpu["correlation"] == NONE)
        if need_h.size == 0 and need_g.size == 0:
            return
        f = _concat(
            self.flows,
            {"id": np.int64, "start": np.bool_, "pid": np.int64, "tid": np.int64, "ts": np.float64},
        )
        f_ts = _to_ns(f["ts"], origin)
        keys = zip(
            f["pid"].tolist(),
            f["tid"].tolist(),
            f_ts.tolist(),
            f["id"].tolist(),
            f["start"].tolist(),
            strict=True,
        )
        starts: dict[tuple[int, int, int], int] = {}
        ends: dict[tuple[int, int, int], int] = {}
        for pid, tid, ts, cid, is_start in keys:
            (starts if is_start else ends)[(pid, tid, ts)] = cid
        for i in need_h:
            c = starts.get((int(host["pid"][i]), int(host["tid"][i]), int(host_ts[i])))
            if c is not None:
                host["correlation"][i] = c
        for i in need_g:
            c = ends.get((int(gpu["pid"][i]), int(gpu["tid"][i]), int(gpu_ts[i])))
            if c is not None:
                gpu["correlation"][i] = c


_HOST_DTYPES = {
    "name": np.int32,
    "kind": np.int8,
    "ts": np.float64,
    "dur": np.float64,
    "pid": np.int64,
    "tid": np.int64,
    "correlation": np.int64,
    "external_id": np.int64,
}
_GPU_DTYPES = {
    "name": np.int32,
    "kind": np.int8,
    "ts": np.float64,
    "dur": np.float64,
    "device": np.int32,
    "stream": np.int64,
    "pid": np.int64,
    "tid": np.int64,
    "correlation": np.int64,
    "bytes": np.int64,
    "blocks_per_sm": np.float32,
    "occupancy": np.float32,
}
_MEM_DTYPES = {
    "ts": np.float64,
    "device_type": np.int8,
    "device_id": np.int32,
    "addr": np.int64,
    "bytes": np.int64,
    "total_allocated": np.int64,
    "total_reserved": np.int64,
}


def _concat(parts: list[dict[str, np.ndarray]], dtypes: dict[str, Any]) -> dict[str, np.ndarray]:
    if not parts:
        return {k: np.empty(0, dt) for k, dt in dtypes.items()}
    if len(parts) == 1:
        return parts[0]
    out = {k: np.concatenate([p[k] for p in parts]) for k in dtypes}
    parts.clear()
    return out


def _origin(*arrays: np.ndarray) -> int:
    """Whole-µs origin: subtracting it first keeps the µs→ns conversion exact for epoch times."""
    lows = [float(a.min()) for a in arrays if a.size]
    return int(np.floor(min(lows))) if lows else 0


def _to_ns(ts_us: np.ndarray, origin: int) -> np.ndarray:
    # ts - origin is exact in float64 (both near each other), so rounding happens on small values.
    return origin * 1000 + np.rint((ts_us - origin) * 1000.0).astype(np.int64)


def _copy_tables(strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per-string memcpy direction and host memory kind, parsed once per distinct name."""
    n = len(strings)
    kinds = np.full(max(n, 1), CopyKind.NONE, np.int8)
    mems = np.full(max(n, 1), HostMem.NONE, np.int8)
    for i, s in enumerate(strings):
        if "Memcpy" in s or "memcpy" in s:
            kinds[i], mems[i] = _copy_kind(s)
    return kinds, mems


_DIRECTIONS = (
    ("HtoD", CopyKind.HTOD),
    ("DtoH", CopyKind.DTOH),
    ("DtoD", CopyKind.DTOD),
    ("HtoH", CopyKind.HTOH),
    ("PtoP", CopyKind.PTOP),
)


def _copy_kind(name: str) -> tuple[int, int]:
    kind = next((k for tag, k in _DIRECTIONS if tag in name), CopyKind.UNKNOWN)
    if kind in (CopyKind.HTOD, CopyKind.DTOH, CopyKind.HTOH):
        mem = (
            HostMem.PAGEABLE
            if "Pageable" in name
            else HostMem.PINNED
            if "Pinned" in name
            else HostMem.UNKNOWN
        )
    else:
        mem = HostMem.NONE
    return int(kind), int(mem)


def _devices(props: Any) -> list[DeviceInfo]:
    if not isinstance(props, list):
        return []
    out = []
    for i, d in enumerate(props):
        if not isinstance(d, dict):
            continue
        dev_id = _int(d.get("id"))
        out.append(
            DeviceInfo(
                id=dev_id if dev_id != NONE else i,
                name=str(d.get("name", "")),
                total_memory=max(_int(d.get("totalGlobalMem")), 0),
                num_sms=max(_int(d.get("numSms")), 0),
                compute_major=max(_int(d.get("computeMajor")), 0),
                compute_minor=max(_int(d.get("computeMinor")), 0),
            )
        )
    return out


def _small(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool)) or v is None
