"""Deeper analyses delegated to Holistic Trace Analysis (HTA 0.5.0, extra ``stepdoctor[hta]``).

HTA already does critical-path analysis and kernel-level trace diffs well, so we run it rather than
re-implement it, and turn its DataFrames into plain JSON-ready dicts shaped like our report sections
(µs, shares as fractions, stable key order) so the server can store and render them like ours.

Why the staging: HTA wants a trace *directory*, guesses each file's rank with a regex (falling back to
rank 0, so compact JSON or traces without ``distributedInfo`` collide or land on the wrong rank) and
picks the decoder from the file suffix. We stage the one file we mean under a temp directory with a
suffix matching its bytes (a symlink; nothing is rewritten) and hand HTA an explicit
``{rank: file}`` map, so no rank guess is ever made and rank-less traces work unchanged.

HTA is imported inside the functions: the engine must import without it. Its logging and warnings
are silenced for the duration of a call; we never call the parts that plot (``fig.show()``) or print
(``CPGraph.summary()``). Any failure inside HTA becomes a one-line ``TraceError``.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import itertools
import logging
import os
import re
import tempfile
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import TraceError

HTA_VERSION = "0.5.0"
INSTALL_HINT = "install 'stepdoctor[hta]'"
TOP_N = 15

# Critical-path bound types, in display order. HTA's labels map onto them (gpu_kernel_kernel_overhead,
# gpu_kernel_launch_overhead, cpu_bound, gpu_compute_bound, gpu_communication_bound); we split two of
# its buckets: host time inside a DataLoader fetch is ``data_loading`` (HTA: cpu_bound) and device
# memcpy/memset is ``gpu_memory`` (HTA: gpu_compute_bound), as input and transfer are separate
# bottleneck kinds for us.
BOUND_TYPES = (
    "kernel_kernel_overhead",
    "launch_overhead",
    "data_loading",
    "cpu",
    "gpu_compute",
    "gpu_memory",
    "communication",
)
_LOADER_PREFIXES = ("enumerate(DataLoader)", "enumerate(DataPipe)")
_GPU_MEMORY_RE = re.compile(r"^(Memcpy|Memset|dma)")
_STEP_RE = re.compile(r"^ProfilerStep\s*#\s*(\d+)$")
_RANK_RE = re.compile(rb'"distributedInfo"\s*:\s*\{[^{}]*?"rank"\s*:\s*(\d+)')
_CHUNK = 1 << 20


def available() -> bool:
    """Whether HTA can be imported (the ``stepdoctor[hta]`` extra is installed)."""
    try:
        return importlib.util.find_spec("hta") is not None
    except (ImportError, ValueError):
        return False


# --------------------------------------------------------------------------------------------------
# Staging: one file, explicit rank, a suffix HTA understands.


@dataclass(frozen=True)
class _Source:
    path: Path
    rank: int
    gz: bool


def _is_gzip(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _chunks(p: Path, gz: bool) -> Iterator[bytes]:
    opener = gzip.open if gz else open
    with opener(p, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def trace_rank(p: Path) -> int | None:
    """The rank in the trace's ``distributedInfo``, found by a streamed scan (None if absent)."""
    tail = b""
    try:
        for chunk in _chunks(p, _is_gzip(p)):
            buf = tail + chunk
            m = _RANK_RE.search(buf)
            if m:
                return int(m.group(1))
            tail = buf[-4096:]
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceError(f"{p.name}: unreadable trace ({exc})") from None
    return None


def _trace_files(d: Path) -> list[Path]:
    return sorted(f for f in d.iterdir() if f.is_file() and f.name.endswith((".json", ".json.gz", ".gz")))


def _resolve(path: str | Path, rank: int | None) -> _Source:
    """Pick the file to analyse and its rank (a file's own rank wins; no rank at all means 0)."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file or directory")
    if p.is_dir():
        files = _trace_files(p)
        if not files:
            raise TraceError(f"{p.name}: no .json or .json.gz traces in this directory")
        ranked = [(trace_rank(f), f) for f in files]
        if len(ranked) == 1:
            own, f = ranked[0]
            return _check_rank(f, own, rank)
        known = {r: f for r, f in ranked if r is not None}
        want = rank if rank is not None else min(known, default=None)
        if want is None or want not in known:
            raise TraceError(
                f"{p.name}: no trace for rank {want} (ranks found: {sorted(known) or 'none'}); pass one file"
            )
        return _Source(known[want], want, _is_gzip(known[want]))
    return _check_rank(p, trace_rank(p), rank)


def _check_rank(f: Path, own: int | None, rank: int | None) -> _Source:
    if rank is not None and own is not None and own != rank:
        raise TraceError(f"{f.name}: trace is rank {own}, not rank {rank}")
    return _Source(f, own if own is not None else (rank or 0), _is_gzip(f))


@contextlib.contextmanager
def _staged(src: _Source) -> Iterator[tuple[str, dict[int, str]]]:
    """A temp directory holding the trace under a suffix that matches its bytes."""
    with tempfile.TemporaryDirectory(prefix="stepdoctor-hta-") as d:
        staged = Path(d) / f"rank{src.rank}.json{'.gz' if src.gz else ''}"
        try:
            os.symlink(src.path.resolve(), staged)
        except OSError:  # no symlinks here (e.g. Windows without privileges): copy
            staged.write_bytes(src.path.read_bytes())
        yield d, {src.rank: str(staged)}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence HTA's logger and pandas' warnings for the call; restore both after."""
    log = logging.getLogger("hta")
    level, disabled = log.level, log.disabled
    log.disabled = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)
        log.disabled = disabled


def require_hta() -> None:
    """Raise the one-line install hint unless HTA is importable."""
    if not available():
        raise TraceError(f"deep analysis needs Holistic Trace Analysis: {INSTALL_HINT}")


def _hta_error(what: str, src: Path, exc: BaseException) -> TraceError:
    msg = " ".join(str(exc).split())[:200] or type(exc).__name__
    return TraceError(f"{src.name}: HTA could not run {what}: {type(exc).__name__}: {msg}")


# --------------------------------------------------------------------------------------------------
# Critical path


def critical_path(
    path: str | Path, *, rank: int | None = None, step: int | None = None, top: int = TOP_N
) -> dict[str, Any]:
    """HTA's critical path of one step (``ProfilerStep#step``) of one rank, as a JSON-ready dict.

    ``step=None`` picks the first full step: the second of ≥ 3 steps (the first usually carries
    warm-up), else the first; the last of several only when asked for by number (it may be cut
    off, which is why HTA drops its kernels by default). Without step markers: the whole trace.
    """
    require_hta()
    src = _resolve(path, rank)
    with _quiet(), _staged(src) as (tmp, files):
        try:
            from hta.trace_analysis import TraceAnalysis

            # Keep the last step's kernels: the window clip below drops what lies outside the
            # chosen step anyway, and a user may ask for the last step by number.
            ta = TraceAnalysis(trace_files=files, trace_dir=tmp, include_last_profiler_step=True)
            steps = _step_numbers(ta.t.symbol_table.get_sym_id_map())
            chosen = _choose_step(steps, step, src.path)
            df = ta.t.get_trace(src.rank)
            if not bool((df["stream"] >= 0).any()):
                raise TraceError(
                    f"{src.path.name}: no GPU activity; critical path analysis needs GPU kernels"
                )
            annotation, instance = _hta_window(ta, src.rank, chosen)
            result = ta.critical_path_analysis(rank=src.rank, annotation=annotation, instance_id=instance)
            if not result or not result[1]:
                raise TraceError(f"{src.path.name}: HTA found no critical path (the event graph has a cycle)")
            graph = result[0]
            edges = graph.get_critical_path_breakdown()
            if edges is None or edges.empty:
                raise TraceError(f"{src.path.name}: HTA found an empty critical path")
            summary = _summarize_path(graph, edges, ta.t, src.rank, top)
        except TraceError:
            raise
        except Exception as exc:  # HTA raises anything from asserts to pandas errors
            raise _hta_error("critical path analysis", src.path, exc) from None
    return {
        "analysis": "critical_path",
        "engine": "hta",
        "hta_version": HTA_VERSION,
        "source": src.path.name,
        "rank": src.rank,
        "step": chosen,
        "steps_available": steps,
        **summary,
    }


def _step_numbers(sym_index: dict[str, int]) -> list[int]:
    return sorted(int(m.group(1)) for k in sym_index if (m := _STEP_RE.match(k)))


def _choose_step(steps: list[int], step: int | None, p: Path) -> int | None:
    if step is not None:
        if step not in steps:
            have = f"steps {steps[0]}–{steps[-1]}" if steps else "no ProfilerStep markers"
            raise TraceError(f"{p.name}: no ProfilerStep#{step} in the trace ({have})")
        return step
    if not steps:
        return None
    return steps[1] if len(steps) >= 3 else steps[0]


def _hta_window(ta: Any, rank: int, step: int | None) -> tuple[str, int | None]:
    """HTA's (annotation, instance) for ``ProfilerStep#step``.

    HTA matches the annotation as a substring and takes the instance-th match in frame order, so
    "ProfilerStep#1" also matches #10–#19; we locate the exact step among those matches ourselves.
    """
    if step is None:
        return "", None
    annotation = f"ProfilerStep#{step}"
    sym = ta.t.symbol_table.get_sym_id_map()
    ids = [v for k, v in sym.items() if annotation in k]
    exact = sym.get(annotation)
    names = ta.t.get_trace(rank)["name"]
    matches = names[names.isin(ids)].tolist()
    if exact is None or exact not in matches:
        raise TraceError(f"ProfilerStep#{step} was dropped by HTA's loader (no events in it?)")
    return annotation, matches.index(exact)


def _summarize_path(graph: Any, edges: Any, t: Any, rank: int, top: int) -> dict[str, Any]:
    """Walk the path's edges in time order and bucket their weights by our bound types.

    HTA's own ``bound_by`` sums (from its breakdown frame) are kept as ``hta_breakdown``, a cross-check
    and a bridge for users who know HTA. Per-op time counts only the op's own span edges: HTA files a
    kernel-kernel gap under the kernel before it, which is overhead, not that kernel's time.
    """
    from hta.utils.utils import is_comm_kernel

    sym = t.symbol_table.get_sym_table()
    full = t.get_trace(rank)
    loaders = _loader_windows(full, sym)
    nodes = [graph.node_list[n] for n in graph.critical_path_nodes]
    by_bound = dict.fromkeys(BOUND_TYPES, 0.0)
    per_event: dict[int, float] = {}
    for u, v in itertools.pairwise(graph.critical_path_nodes):
        e = graph.edges[u, v]["object"]
        if not e.weight:
            continue
        kind = e.type.value
        if kind == "critical_path_kernel_kernel_delay":
            by_bound["kernel_kernel_overhead"] += e.weight
            continue
        if kind == "critical_path_kernel_launch_delay":
            by_bound["launch_overhead"] += e.weight
            continue
        ev = graph.get_event_attribution_for_edge(e)
        if ev is None:  # an unattributed span: HTA leaves it unlabelled; it is host time
            by_bound["cpu"] += e.weight
            continue
        per_event[ev] = per_event.get(ev, 0.0) + e.weight
        name = sym[int(full.at[ev, "name"])]
        if int(full.at[ev, "stream"]) < 0:
            start, end = graph.node_list[u].ts, graph.node_list[v].ts
            fetch = _inside(full, ev, start, end, loaders)
            by_bound["data_loading" if fetch else "cpu"] += e.weight
        elif is_comm_kernel(name):
            by_bound["communication"] += e.weight
        else:
            by_bound["gpu_memory" if _GPU_MEMORY_RE.match(name) else "gpu_compute"] += e.weight
    by_bound = {k: float(v) for k, v in by_bound.items()}
    length = sum(by_bound.values())
    hta_raw = edges[edges["duration"] > 0].groupby("bound_by")["duration"].sum()
    return {
        "length_us": length,
        "path_start_us": float(nodes[0].ts),
        "path_end_us": float(nodes[-1].ts),
        "breakdown": by_bound,
        "shares": {k: (v / length if length else 0.0) for k, v in by_bound.items()},
        "hta_breakdown": {str(k) or "unlabelled": float(v) for k, v in sorted(hta_raw.items())},
        "top": _top_ops(per_event, full, sym, length, top),
        "events_on_path": len(per_event),
        "edges_on_path": len(nodes) - 1,
        "warnings": [] if "cuda_sync" in t.symbol_table.get_sym_id_map() else [_NO_SYNC_WARNING],
    }


_NO_SYNC_WARNING = (
    "the trace has no cuda_sync events, so host-device synchronization is missing from the path "
    "(record with a PyTorch >= 2.1 profiler)"
)


def _loader_windows(full: Any, sym: list[str]) -> list[tuple[int, int, int, int]]:
    """(pid, tid, start, end) of DataLoader/DataPipe fetches on the host."""
    ids = {i for i, s in enumerate(sym) if s.startswith(_LOADER_PREFIXES)}
    if not ids:
        return []
    rows = full[full["name"].isin(ids) & full["stream"].lt(0)]
    return [(int(r.pid), int(r.tid), int(r.ts), int(r.ts + r.dur)) for r in rows.itertuples(index=False)]


def _inside(full: Any, ev: int, start: int, end: int, windows: list[tuple[int, int, int, int]]) -> bool:
    """Whether the span [start, end] of a host event lies inside a DataLoader fetch on its thread."""
    if not windows:
        return False
    pid, tid = int(full.at[ev, "pid"]), int(full.at[ev, "tid"])
    return any(p == pid and t == tid and s <= start and end <= e for p, t, s, e in windows)


def _top_ops(
    per_event: dict[int, float], full: Any, sym: list[str], length: float, top: int
) -> list[dict[str, Any]]:
    """Ops/kernels by time on the path, events of the same name and kind summed."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for ev, us in per_event.items():
        name, cat = sym[int(full.at[ev, "name"])], sym[int(full.at[ev, "cat"])]
        dur = float(full.at[ev, "dur"])
        r = rows.setdefault(
            (name, cat),
            {
                "name": name,
                "kind": cat,
                "device": "gpu" if full.at[ev, "stream"] >= 0 else "cpu",
                "us": 0.0,
                "share": 0.0,
                "events": 0,
                "longest_event_us": 0.0,
            },
        )
        r["us"] += us
        r["events"] += 1
        r["longest_event_us"] = max(r["longest_event_us"], dur)
    out = sorted(rows.values(), key=lambda r: (-r["us"], r["name"]))[:top]
    for r in out:
        r["share"] = r["us"] / length if length else 0.0
    return out


# --------------------------------------------------------------------------------------------------
# Trace diff


def trace_diff(
    base_path: str | Path,
    other_path: str | Path,
    *,
    base_rank: int | None = None,
    other_rank: int | None = None,
    base_step: int | None = None,
    other_step: int | None = None,
    top: int = TOP_N * 2,
) -> dict[str, Any]:
    """HTA's TraceDiff of one step of each trace: ops and kernels added, removed, changed.

    Steps default as in ``critical_path`` (the first full step), so a warm-up step is not compared
    with a steady one. Rows are grouped by full name, separately for host ops and device kernels.
    """
    require_hta()
    base, other = _resolve(base_path, base_rank), _resolve(other_path, other_rank)
    with _quiet(), _staged(base) as (tmp_b, files_b), _staged(other) as (tmp_o, files_o):
        try:
            from hta.common.trace import Trace
            from hta.trace_diff import DeviceType, LabeledTrace, TraceDiff

            lb = LabeledTrace(label="base", t=Trace(trace_files=files_b, trace_dir=tmp_b))
            lo = LabeledTrace(label="other", t=Trace(trace_files=files_o, trace_dir=tmp_o))
            sb = _choose_step(lb.iterations(), base_step, base.path)
            so = _choose_step(lo.iterations(), other_step, other.path)
            if sb is None or so is None:
                bad = base.path if sb is None else other.path
                raise TraceError(f"{bad.name}: trace diff needs ProfilerStep markers (none in the trace)")
            rows: list[dict[str, Any]] = []
            for device, dt in (("gpu", DeviceType.GPU), ("cpu", DeviceType.CPU)):
                comp = TraceDiff.compare_traces(
                    lb,
                    lo,
                    control_rank=base.rank,
                    test_rank=other.rank,
                    control_iteration=sb,
                    test_iteration=so,
                    device_type=dt,
                )
                rows.extend(_diff_rows(comp, device))
        except TraceError:
            raise
        except Exception as exc:
            raise _hta_error("trace diff", base.path, exc) from None
    return {
        "analysis": "trace_diff",
        "engine": "hta",
        "hta_version": HTA_VERSION,
        "base": {"source": base.path.name, "rank": base.rank, "step": sb},
        "other": {"source": other.path.name, "rank": other.rank, "step": so},
        "summary": {d: _diff_summary([r for r in rows if r["device"] == d]) for d in ("gpu", "cpu")},
        "top": sorted(rows, key=lambda r: (-abs(r["delta_us"]), r["device"], r["name"]))[:top],
    }


def _diff_rows(comp: Any, device: str) -> list[dict[str, Any]]:
    out = []
    for name, r in comp.iterrows():
        if str(name).startswith("ProfilerStep#"):
            continue  # the step marker itself: its duration is the step time, not an op
        bc, oc = int(r["base_counts"]), int(r["other_counts"])
        bu, ou = float(r["base_total_duration"]), float(r["other_total_duration"])
        out.append(
            {
                "name": str(name),
                "device": device,
                "change": _change(bc, oc),
                "base_count": bc,
                "other_count": oc,
                "delta_count": oc - bc,
                "base_us": bu,
                "other_us": ou,
                "delta_us": ou - bu,
            }
        )
    return out


def _change(base_count: int, other_count: int) -> str:
    if not base_count:
        return "added"
    if not other_count:
        return "removed"
    if other_count != base_count:
        return "more" if other_count > base_count else "fewer"
    return "same"


def _diff_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    changes = [r["change"] for r in rows]
    base_us = sum(r["base_us"] for r in rows)
    other_us = sum(r["other_us"] for r in rows)
    return {
        "names": len(rows),
        "added": changes.count("added"),
        "removed": changes.count("removed"),
        "count_changed": changes.count("more") + changes.count("fewer"),
        "unchanged": changes.count("same"),
        "base_count": sum(r["base_count"] for r in rows),
        "other_count": sum(r["other_count"] for r in rows),
        "base_us": base_us,
        "other_us": other_us,
        "delta_us": other_us - base_us,
    }


# --------------------------------------------------------------------------------------------------
# Terminal rendering (the CLI's text format)


def _fmt_us(us: float) -> str:
    if abs(us) >= 1e6:
        return f"{us / 1e6:.2f} s"
    if abs(us) >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs"


def _cut(s: str, n: int = 60) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def render_text(result: dict[str, Any]) -> str:
    """A short table for ``stepdoctor analyze --deep …`` (text format)."""
    if result.get("analysis") == "trace_diff":
        return _render_diff(result)
    step = f"step {result['step']}" if result.get("step") is not None else "whole trace"
    lines = [
        f"Critical path (HTA {result['hta_version']}) — rank {result['rank']}, {step}: "
        f"{_fmt_us(result['length_us'])}",
        "",
        f"  {'bound by':<24}{'time':>12}{'share':>8}",
    ]
    for k, us in result["breakdown"].items():
        if us:
            lines.append(f"  {k:<24}{_fmt_us(us):>12}{result['shares'][k]:>8.1%}")
    lines += ["", f"  {'top ops/kernels on the path':<62}{'time':>12}{'share':>8}"]
    for r in result["top"]:
        lines.append(f"  {_cut(r['name']):<62}{_fmt_us(r['us']):>12}{r['share']:>8.1%}")
    lines += [f"warning: {w}" for w in result.get("warnings", [])]
    return "\n".join(lines) + "\n"


def _render_diff(result: dict[str, Any]) -> str:
    b, o = result["base"], result["other"]
    lines = [
        f"Trace diff (HTA {result['hta_version']}): {b['source']} (step {b['step']}) → "
        f"{o['source']} (step {o['step']})",
        "",
        f"  {'':<6}{'names':>7}{'added':>7}{'removed':>9}{'changed':>9}{'base':>12}{'other':>12}{'delta':>12}",
    ]
    for dev, s in result["summary"].items():
        lines.append(
            f"  {dev:<6}{s['names']:>7}{s['added']:>7}{s['removed']:>9}{s['count_changed']:>9}"
            f"{_fmt_us(s['base_us']):>12}{_fmt_us(s['other_us']):>12}{_fmt_us(s['delta_us']):>12}"
        )
    lines += ["", f"  {'op / kernel':<56}{'dev':>4}{'change':>9}{'count':>11}{'Δ time':>12}"]
    for r in result["top"]:
        if r["change"] == "same" and not r["delta_us"]:
            continue
        count = f"{r['base_count']}→{r['other_count']}"
        lines.append(
            f"  {_cut(r['name'], 56):<56}{r['device']:>4}{r['change']:>9}{count:>11}{_fmt_us(r['delta_us']):>12}"
        )
    return "\n".join(lines) + "\n"
