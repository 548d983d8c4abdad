"""``stepdoctor trim IN OUT --steps 5-6``: write a smaller trace holding only those steps (``trim``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..errors import TraceError
from ..parsing.trim import parse_steps, trim_trace
from .analyze import byte_size, byte_text


def _steps(text: str) -> tuple[int, int]:
    try:
        return parse_steps(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stepdoctor trim",
        description="Cut ProfilerSteps out of a big Chrome trace: the result opens in Perfetto and TensorBoard.",
    )
    p.add_argument("src", help="trace file (.json or .json.gz)")
    p.add_argument("dst", help="output file; gzip when it ends in .gz (e.g. step5.pt.trace.json.gz)")
    p.add_argument("--steps", type=_steps, required=True, help="a ProfilerStep number (5) or a range (5-6)")
    p.add_argument("--max-bytes", type=byte_size, default=None, help="refuse larger decompressed traces")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    first, last = args.steps
    try:
        result = trim_trace(args.src, args.dst, first, last, max_bytes=args.max_bytes)
    except TraceError as exc:
        print(f"stepdoctor trim: {exc}", file=sys.stderr)
        Path(args.dst).unlink(missing_ok=True)
        return 2
    except OSError as exc:
        print(f"stepdoctor trim: {exc.filename or args.src}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    before, after = Path(args.src).stat().st_size, Path(args.dst).stat().st_size
    print(
        f"steps {first}-{last}: kept {result.kept:,} of {result.kept + result.dropped:,} events, "
        f"{byte_text(before)} -> {byte_text(after)}: {args.dst}"
    )
    return 0
