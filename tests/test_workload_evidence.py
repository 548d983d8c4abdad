"""Workload evidence read from the trace: grad mode from the ops autograd recorded."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from stepdoctor_analysis import parse
from stepdoctor_analysis.parsing.schema import MATMUL_OPS

CUDA = Path(__file__).parent / "fixtures" / "traces" / "cuda"


def _seq_counts(path: Path) -> tuple[int, int]:
    """Independent of the parser: matmul-class cpu_ops, and those carrying a "Sequence number"."""
    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    rx = re.compile(MATMUL_OPS)
    ops = [e for e in events if e.get("cat") == "cpu_op" and rx.match(e.get("name", ""))]
    return len(ops), sum("Sequence number" in e.get("args", {}) for e in ops)


@pytest.mark.parametrize("name", ["input.json.gz", "inference_unscheduled.json.gz", "launch.after.json.gz"])
def test_parser_reads_sequence_numbers_on_matmul_ops_as_recorded(name: str) -> None:
    trace = parse.load_trace(CUDA / name)
    rx = re.compile(MATMUL_OPS)
    matmul = [i for i, n in enumerate(trace.host.name.tolist()) if rx.match(trace.strings[n])]
    n_ops, n_seq = _seq_counts(CUDA / name)
    assert len(matmul) == n_ops
    assert int((trace.host.grad_seq[matmul] >= 0).sum()) == n_seq
    assert int((trace.host.grad_seq >= 0).sum()) == n_seq  # never on an op outside MATMUL_OPS
