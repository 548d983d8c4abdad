"""``stepdoctor.profile``: torch.profiler on a schedule, with every window spooled and shipped.

The training thread does only what plain ``torch.profiler`` does (stop the trace, export the raw
JSON) plus a rename and a small sidecar write; gzip and HTTP happen on the delivery thread.

A spool that cannot be written (full disk, read-only or missing folder) costs the window, never the
run: one line names the folder and the reason, the window counts as lost in the exit line, and
training goes on. torch.profiler does not raise when it cannot write (Kineto logs and leaves a
``.tmp``), so the export is checked for being there and complete before it is committed.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import logging
import os
import sys
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import stepdoctor.config as _config
import stepdoctor.memory_snapshot as _memory_snapshot
import stepdoctor.memory_timeline as _memory_timeline
import stepdoctor.metadata as _metadata
import stepdoctor.on_demand as _on_demand
import stepdoctor.series as _series
from stepdoctor.guard import guarded, log_once, raise_errors, say
from stepdoctor.spool import FAILED_DIR, UPLOADED_DIR, Spool
from stepdoctor.worker import DeliveryWorker, Stats

_live: weakref.WeakSet[Profile] = weakref.WeakSet()
_PID = os.getpid()  # kept current by the fork hook: os.getpid() is a syscall, step() is hot
_perf_ns = time.perf_counter_ns


def _after_fork_in_child() -> None:
    global _PID
    _PID = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


class NoopProfile:
    """Same API as :class:`Profile`, doing nothing: disabled agent, missing torch, or bad config."""

    enabled = False
    profiler: Any = None
    run_dir: Path | None = None
    captured = 0
    lost = 0
    stats = Stats()

    def __enter__(self) -> NoopProfile:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def start(self) -> NoopProfile:
        return self

    def stop(self, *, clean: bool = True) -> None:
        return None

    def step(self) -> None:
        return None

    def watch(self, loader: Any) -> Any:
        return loader

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def summary(self) -> str:
        return "stepdoctor: disabled, nothing captured"


class Profile:
    """A running capture session; create it with :func:`profile`."""

    enabled = True

    def __init__(
        self,
        cfg: _config.AgentConfig,
        *,
        loader: Any = None,
        metadata: dict[str, Any] | None = None,
        activities: Any = None,
        profile_memory: bool = True,
        record_shapes: bool = True,
        with_stack: bool = False,
        schedule: Callable[[int], Any] | None = None,
        profiler_kwargs: dict[str, Any] | None = None,
        series: _series.SeriesSettings | None = None,
        on_demand_interval: float | None = None,
        memory_snapshot: bool = False,
        memory_timeline: bool = False,
    ) -> None:
        self.config = cfg
        self._memory_timeline = (
            memory_timeline  # torch's memory categories in each trace (memory_timeline.py)
        )
        self._memory_snapshot = (
            memory_snapshot  # the CUDA allocator's history per window (memory_snapshot.py)
        )
        self.profiler: Any = None
        self.run_dir: Path | None = None
        self.captured = 0
        self.lost = 0  # windows recorded but not written (full disk, read-only spool)
        self._lost_reason = ""
        self._loader = loader
        self._extra_meta = dict(metadata or {})
        self._profiler_options = {
            "activities": activities,
            "profile_memory": profile_memory,
            "record_shapes": record_shapes,
            "with_stack": with_stack,
        }
        self._profiler_kwargs = dict(profiler_kwargs or {})
        # A schedule passed either way is the user's: opaque to our next-window prediction.
        self._schedule = self._profiler_kwargs.pop("schedule", None) or schedule
        self._user_trace_ready: Callable[[Any], Any] | None = self._profiler_kwargs.pop(
            "on_trace_ready", None
        )
        self._lock = threading.Lock()
        self._state = "new"
        self._pid = os.getpid()
        self._window_index = 0
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._recording: frozenset[Any] = frozenset()
        self._none: Any = None
        self._tp: Any = None
        self._kwargs: dict[str, Any] = {}
        self._schedule_fn: Callable[[int], Any] = lambda step: None
        self._active: Any = None  # the torch profiler of the window in progress
        self._step_num = 0
        self._next_window = 0  # steps before this one need no schedule lookup
        self._static_meta: dict[str, Any] = {}
        self._worker: DeliveryWorker | None = None
        # the step series and anomaly capture (stepdoctor.series)
        self._series_settings = series if series is not None else _series.SeriesSettings()
        self._series: _series.SeriesRecorder | None = None
        self._base_schedule: Callable[[int], Any] = lambda step: None
        self._forced: tuple[int, int] | None = None  # [first, end) of a window asked for off-schedule
        self._forced_capture: dict[str, Any] = {}
        self._window_capture: dict[str, Any] = {"reason": "schedule"}
        # capture on demand (stepdoctor.on_demand): the polling thread, and a request it handed over
        self._on_demand_interval = on_demand_interval  # None: off
        self._poller: _on_demand.DemandPoller | None = None
        self._demand: _on_demand.Demand | None = None

    @property
    def stats(self) -> Stats:
        return self._worker.stats if self._worker is not None else Stats()

    # --- context manager ----------------------------------------------------------------------

    def __enter__(self) -> Profile:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(clean=_clean_exit(exc[1] if len(exc) > 1 else None))

    # --- public API ---------------------------------------------------------------------------

    @guarded()
    def start(self) -> Profile:
        with self._lock:
            if self._state != "new":
                return self
            self._state = "starting"
        import torch.profiler as tp

        cfg = self.config
        spool = Spool(cfg.spool)
        try:
            self.run_dir = spool.run_dir(cfg.project, cfg.run)
        except OSError as exc:  # each window tries again: the disk may be freed while we train
            self.run_dir = spool.root / cfg.project / cfg.run
            self._cannot_write(exc, "traces")
        # Extra metadata (a framework's settings) never replaces what the agent measured itself.
        self._static_meta = {**self._extra_meta, **_metadata.collect(cfg.tags, self._loader)}
        self._worker = DeliveryWorker(spool, self._router(), cfg.delivery, cleanup=True)
        self._worker.notify()  # deliver what earlier runs left behind while we train
        self._tp = tp
        self._none = tp.ProfilerAction.NONE
        self._recording = frozenset({tp.ProfilerAction.RECORD, tp.ProfilerAction.RECORD_AND_SAVE})
        self._kwargs = self._torch_kwargs(tp)
        # Each window is exported before the next starts, so torch's "clears events" notice is noise.
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events", category=UserWarning)
        self._base_schedule = self._kwargs["schedule"]
        self._kwargs["schedule"] = self._schedule_fn = self._schedule_with_forced
        self._start_series()
        self._state = "running"
        _live.add(self)
        self._start_on_demand()
        if self._schedule_fn(0) != self._none:
            self._open_window(0)
        if self._series is not None:
            self._series.restart_clock()
        return self

    def step(self) -> None:
        """Mark the end of a training step. Outside capture windows this appends the step's wall
        time and data wait to two arrays and compares a few numbers (torch.profiler itself is not
        running; bench/step_series_cost.py measures it); it never touches the disk or the network."""
        if self._active is None:
            series = self._series
            if series is not None:
                now = _perf_ns()
                wall = now - series.last
                series.last = now
                series.wall.append(wall)
                series.data.append(series.data_acc)
                series.data_acc = series.data_reset
                if wall > series.threshold or now >= series.due or self._step_num >= series.next_step:
                    series.event(self._step_num, now, wall)
            self._step_num += 1
            if self._step_num < self._next_window or self._state != "running" or self._pid != _PID:
                return
            if self._demand is not None:
                self._take_demand(self._step_num)
            if self._schedule_fn(self._step_num) == self._none:
                self._next_window = self._find_next_window(self._step_num + 1)
                if self._demand is not None:  # handed over meanwhile by the polling thread
                    self._next_window = self._step_num + 1
                return
            self._open_window(self._step_num)
            if series is not None:
                series.restart_clock()
        elif self._state == "running" and self._pid == _PID:
            series = self._series
            if series is not None:
                series.profiled_step(self._step_num)
            self._step_in_window()
            if series is not None:
                series.restart_clock()

    def _find_next_window(self, step: int) -> int:
        """First step >= ``step`` the schedule does not skip, from our own schedule parameters (a user's
        schedule callable is opaque, so then it is asked every step)."""
        if self._schedule is not None:
            return step
        found = next_window_start(step, *self.config.schedule.resolved())
        if self._forced is not None and self._forced[1] > step:
            found = min(found, max(step, self._forced[0]))
        return found

    def _schedule_with_forced(self, step: int) -> Any:
        """The schedule, with a window asked for off-schedule (a slow step) taking precedence:
        the configured warm-up and active steps, so it is captured like any other window."""
        forced = self._forced
        if forced is not None and forced[0] <= step < forced[1]:
            warmup = self.config.schedule.resolved()[2]
            tp = self._tp
            if step < forced[0] + warmup:
                return tp.ProfilerAction.WARMUP
            if step < forced[1] - 1:
                return tp.ProfilerAction.RECORD
            return tp.ProfilerAction.RECORD_AND_SAVE
        return self._base_schedule(step)

    @guarded()
    def _start_series(self) -> None:
        """Time every step from here on (``stepdoctor.series``), unless the series is turned off."""
        if not self._series_settings.enabled:
            return
        cfg = self.config
        header = {
            "project": cfg.project,
            "run": cfg.run,
            "rank": _metadata.rank_info()["rank"],
            "host": self._static_meta.get("host"),
            "server": cfg.server,  # routes the chunks, like a trace's sidecar
        }
        worker = self._worker
        self._series = _series.SeriesRecorder(
            self._series_settings,
            lambda: self.run_dir,
            header,
            self._capture_on_anomaly,
            on_written=worker.notify if worker is not None and cfg.server is not None else None,
        )
        if self._loader is not None:
            _series.time_loader(self._loader, self._series)

    def _capture_on_anomaly(self, step: int, wall_ns: int, median_ns: int) -> bool:
        """A step took over k x the rolling median: capture the next window, with why in its
        metadata. Not while a window is open or one asked for is still to come."""
        if self._state != "running" or self._pid != _PID or self._active is not None:
            return False
        if self._forced is not None and self._forced[1] > step:
            return False
        _, _, warmup, active, _ = self.config.schedule.resolved()
        self._forced = (step + 1, step + 1 + warmup + active)
        self._forced_capture = {
            "reason": "anomaly",
            "trigger_step": step,
            "step_ms": round(wall_ns / 1e6, 3),
            "median_ms": round(median_ns / 1e6, 3),
            "k": self._series_settings.anomaly_k,
        }
        self._next_window = min(self._next_window, step + 1)
        return True

    @guarded()
    def _start_on_demand(self) -> None:
        """With a server, poll it for "Capture now" requests while profiling runs (``stepdoctor.on_demand``)."""
        cfg = self.config
        if cfg.server is None or self._on_demand_interval is None:
            return
        self._poller = _on_demand.DemandPoller(
            cfg.server,
            cfg.token,
            cfg.project,
            cfg.run,
            _metadata.rank_info()["rank"],
            self._on_capture_request,
            interval=self._on_demand_interval,
            retry_after_max=cfg.delivery.retry_after_max,
        )
        self._poller.start()

    def _on_capture_request(self, demand: _on_demand.Demand) -> bool:
        """On the polling thread: hand a request to the training thread, which takes it at its next
        step (``_take_demand``). ``_demand`` is set before ``_next_window``, and the training thread
        writes ``_next_window`` before it looks at ``_demand``, so no request is missed."""
        if self._state != "running" or self._pid != os.getpid():
            return False
        self._demand = demand
        self._next_window = 0
        return True

    @guarded()
    def _take_demand(self, step: int) -> None:
        """A "Capture now" request: the window from ``step`` on, with the configured warm-up and active
        steps, and the request in its metadata (after a window asked for that is still to come)."""
        demand = self._demand
        if demand is None or (self._forced is not None and self._forced[1] > step):
            return
        _, _, warmup, active, _ = self.config.schedule.resolved()
        self._forced = (step, step + warmup + active)
        self._forced_capture = {
            "reason": "on_demand",
            "request_id": demand.id,
            "requested_at": demand.requested_at,
        }
        self._demand = None

    def _answer_demand(self, trace_key: str | None, detail: str | None = None) -> None:
        """The window of a "Capture now" request is in the spool (or lost): the polling thread says so."""
        capture, poller = self._window_capture, self._poller
        request_id = capture.get("request_id")
        if poller is not None and capture.get("reason") == "on_demand" and isinstance(request_id, int):
            poller.captured(request_id, trace_key, detail)

    @guarded()
    def _open_window(self, step: int) -> None:
        """Start torch.profiler just before a window, numbered globally so ProfilerStep#N matches."""
        prof = self._tp.profile(**self._kwargs)
        prof.step_num = step
        prof.current_action = self._schedule_fn(step)
        if hasattr(prof, "_prev_schedule_action"):
            prof._prev_schedule_action = prof.current_action
        forced = self._forced
        in_forced = forced is not None and forced[0] <= step < forced[1]
        self._window_capture = dict(self._forced_capture) if in_forced else {"reason": "schedule"}
        preset = getattr(prof, "preset_metadata_json", None)
        if preset is not None:
            preset(
                "stepdoctor", json.dumps({**self._static_meta, "capture": self._window_capture}, default=str)
            )
            if self._needs_distributed_info():
                info = {"rank": self._static_meta["rank"], "world_size": self._static_meta["world_size"]}
                preset("distributedInfo", json.dumps(info))
        self.profiler = self._active = prof
        try:
            prof.start()
        except Exception:
            self._active = None
            self._state = "broken"
            raise
        if self._memory_snapshot:
            _memory_snapshot.start()

    @guarded()
    def _step_in_window(self) -> None:
        prof = self._active
        if prof.current_action in self._recording:
            self._note_step(prof.step_num)
        try:
            prof.step()
            self._step_num = prof.step_num
            if prof.current_action == self._none:  # window saved: leave torch.profiler until the next one
                self._active = None
                prof.stop()
        except Exception:
            self._active = None
            self._state = "broken"  # a profiler in an unknown state must not be stepped again
            raise

    @guarded()
    def watch(self, loader: Any) -> Any:
        """Record a DataLoader's settings with later traces; returns the loader for inline use."""
        self._loader = loader
        if self._static_meta:
            self._static_meta["loader"] = _metadata.loader_settings(loader)
        if self._series is not None:
            _series.time_loader(loader, self._series)
        return loader

    @guarded(default=False)
    def flush(self, timeout: float | None = None) -> bool:
        """Wait (bounded) until spooled traces are delivered; True when nothing is left to send."""
        if self._worker is None:
            return True
        return self._worker.flush(self.config.delivery.flush_timeout if timeout is None else timeout)

    @guarded()
    def stop(self, *, clean: bool = True) -> None:
        """Stop capturing, flush uploads within ``flush_timeout``, and log what is left in one line.

        ``clean=False``: training ended with an exception (the step series' last chunk says so)."""
        with self._lock:
            if self._state not in ("running", "broken") or os.getpid() != self._pid:
                return
            broken = self._state == "broken"
            self._state = "stopped"
        _live.discard(self)
        try:
            prof, self._active = self._active, None
            if prof is not None and not broken:
                if prof.current_action in self._recording:
                    self._note_step(prof.step_num)
                prof.stop()  # a window cut short is still saved
        finally:
            if self._memory_snapshot:
                _memory_snapshot.stop()
            series, self._series = self._series, None
            if series is not None:  # local disk: a few ms, bounded in case it hangs
                series.close(max(2.0, self.config.delivery.flush_timeout), clean=clean)
            exit_by = time.monotonic() + self.config.delivery.flush_timeout
            poller, self._poller = self._poller, None
            if poller is not None:  # a last acknowledgement, within part of the exit budget
                poller.close(min(1.0, self.config.delivery.flush_timeout / 4))
            if self._worker is not None:
                self._worker.close(max(0.0, exit_by - time.monotonic()))
                self._report()

    # --- internals ----------------------------------------------------------------------------

    def _router(self) -> Callable[[dict[str, Any]], tuple[str, str | None] | None] | None:
        server, token = self.config.server, self.config.token
        if server is None:
            return None
        return lambda meta: (server, token) if meta.get("server") == server else None

    def _torch_kwargs(self, tp: Any) -> dict[str, Any]:
        import torch

        activities = self._profiler_options["activities"]
        if activities is None:
            activities = [tp.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(tp.ProfilerActivity.CUDA)
        schedule = self._schedule
        if schedule is None:
            skip_first, wait, warmup, active, repeat = self.config.schedule.resolved()
            schedule = tp.schedule(
                skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat
            )
        kwargs: dict[str, Any] = {
            "activities": activities,
            "schedule": schedule,
            "on_trace_ready": self._on_trace_ready,
            "record_shapes": self._profiler_options["record_shapes"],
            "profile_memory": self._profiler_options["profile_memory"],
            "with_stack": self._profiler_options["with_stack"],
        }
        kwargs.update(self._profiler_kwargs)
        return kwargs

    def _needs_distributed_info(self) -> bool:
        """Kineto writes ``distributedInfo`` only under torch.distributed; launcher env ranks need it too,
        so offline tools can order a directory of per-rank files."""
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        return not initialized and self._static_meta.get("rank") is not None

    def _note_step(self, step: int) -> None:
        if self._first_step is None:
            self._first_step = step
        self._last_step = step

    def _on_trace_ready(self, prof: Any) -> None:
        try:
            self._spool_window(prof)
        finally:
            if self._user_trace_ready is not None:
                self._user_trace_ready(prof)

    @guarded()
    def _spool_window(self, prof: Any) -> None:
        """Runs on the training thread inside prof.step(): export, rename, sidecar, wake the worker."""
        assert self.run_dir is not None and self._worker is not None
        stem = Spool.new_stem()
        window = {
            "index": self._window_index,
            "first_step": self._first_step,
            "last_step": self._last_step,
            "reason": self._window_capture.get("reason", "schedule"),
        }
        self._window_index += 1
        self._first_step = self._last_step = None
        if self._memory_snapshot:  # the window's allocator history, beside its trace; recording stops
            _memory_snapshot.dump(_memory_snapshot.snapshot_path(self.run_dir, stem))
        try:
            self._export(prof, stem)
            if self._memory_timeline:  # torch's categories of the window, inside its trace
                device = _memory_timeline.device_of(self._kwargs.get("activities"))
                _memory_timeline.embed(prof, Spool.export_partial(self.run_dir, stem), device)
            key = self._commit(stem, window)
        except OSError as exc:
            _discard(self.run_dir, stem)
            self.lost += 1
            self._answer_demand(None, f"the window could not be written: {exc.strerror or exc}")
            self._cannot_write(exc, f"the trace of steps {window['first_step']}-{window['last_step']}")
            return
        self.captured += 1
        self._answer_demand(key)
        if self._series is not None:
            self._series.window_saved(window)
        self._worker.notify()

    def _export(self, prof: Any, stem: str) -> None:
        """torch's export into the spool, raising ``OSError`` when the file is missing or cut short."""
        assert self.run_dir is not None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        partial = Spool.export_partial(self.run_dir, stem)
        prof.export_chrome_trace(str(partial))
        if not _complete_json(partial):
            raise _write_problem(self.run_dir) or OSError(
                errno.EIO, "torch.profiler wrote no complete trace file", str(partial)
            )

    def _commit(self, stem: str, window: dict[str, Any]) -> str:
        assert self.run_dir is not None
        cfg = self.config
        ranks = _metadata.rank_info()
        meta = {**self._static_meta, **ranks, "window": window, "capture": self._window_capture}
        sidecar = {
            "format": 1,
            "idempotency_key": uuid.uuid4().hex,
            "project": cfg.project,
            "run": cfg.run,
            "rank": ranks["rank"],
            "window": window,
            "server": cfg.server,
            "metadata": meta,
        }
        Spool.commit_capture(self.run_dir, stem, sidecar)
        return str(sidecar["idempotency_key"])

    def _cannot_write(self, exc: OSError, what: str) -> None:
        """One line per folder and reason, however many windows it costs."""
        reason = exc.strerror or str(exc)
        self._lost_reason = f"cannot write to {self.run_dir}: {reason}"
        say(
            f"stepdoctor: cannot write {what} to {self.run_dir} ({reason}); "
            "windows are lost until it can be written, training continues",
            key=f"spool-write:{self.run_dir}:{exc.errno}",
        )

    def _report(self) -> None:
        """One line on stderr at the end: what was captured, where it is, what was uploaded."""
        say(self.summary())

    def summary(self) -> str:
        assert self._worker is not None
        cfg = self.config
        spool = self._worker.spool
        captured = f"stepdoctor: {_plural(self.captured, 'trace')} captured for {cfg.project}/{cfg.run}"
        if self.lost:
            captured += f", {self.lost} lost ({self._lost_reason})"
        elif self.captured == 0 and self._schedule is None:
            _, _, warmup, _, _ = resolved = cfg.schedule.resolved()
            first = next_window_start(0, *resolved) + warmup
            captured += f" (the loop ran {_plural(self._step_num, 'step')}; recording starts at step {first})"
        if cfg.server is None:
            return (
                f"{captured}, in {self.run_dir} (no STEPDOCTOR_SERVER: not uploaded); read them with "
                f"`stepdoctor analyze {self.run_dir}` or `tensorboard --logdir {cfg.spool}`"
            )
        stats = self._worker.stats
        count, size = spool.pending()
        parts = [f"{stats.delivered} uploaded to {cfg.server}"]
        if stats.delivered and cfg.delivery.spool_max_bytes > 0:
            parts[0] += f" (local copies in {spool.root / UPLOADED_DIR})"
        if stats.rejected:
            parts.append(
                f"{stats.rejected} refused by the server (in {spool.root / FAILED_DIR}, see .reason.txt)"
            )
        if count:
            why = ""
            if stats.sending:
                why = f" (an upload was still running when the {cfg.delivery.flush_timeout:g} s exit budget ran out)"
            elif stats.last_error:
                why = f" ({'server unreachable' if stats.unreachable else 'last try'}: {stats.last_error})"
            parts.append(
                f"{_plural(count, 'trace')} ({size / 1e6:.1f} MB) waiting in {spool.root} "
                f"for the next run or `stepdoctor sync`{why}"
            )
        else:
            parts.append("nothing left to send")
        if stats.series_unsupported:
            parts.append(f"the step series stays in {spool.root} (the server has no step-series endpoint)")
        return f"{captured}; " + ", ".join(parts)


def _complete_json(path: Path) -> bool:
    """Whether torch's export is there and ends like a JSON object (a cut-short write does not)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 256))
            return fh.read().rstrip().endswith(b"}")
    except OSError:
        return False


_PROBE_BYTES = 64 * 1024


def _write_problem(directory: Path) -> OSError | None:
    """Why ``directory`` takes no file (full disk, read-only, file limit), found by writing a small one."""
    probe = directory / f".stepdoctor-probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as fh:
            fh.write(b"\0" * _PROBE_BYTES)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        return exc
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    return None


def _discard(directory: Path, stem: str) -> None:
    """Give a lost window's pieces back to the disk: torch's ``.tmp``, the export, a half sidecar."""
    for path in directory.glob(f"{stem}*"):
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def next_window_start(step: int, skip_first: int, wait: int, warmup: int, active: int, repeat: int) -> int:
    """Smallest step >= ``step`` where ``torch.profiler.schedule(...)`` is not NONE (2**62: never)."""
    cycle = wait + warmup + active
    span = warmup + active
    # window k covers [skip_first + k*cycle + wait, skip_first + (k+1)*cycle - 1]
    k = max(0, -(-(step - skip_first - wait - span + 1) // cycle))
    if repeat and k >= repeat:
        return NEVER
    return max(step, skip_first + k * cycle + wait)


NEVER = 2**62


def profile(
    project: str | None = None,
    run: str | None = None,
    *,
    server: str | None = None,
    token: str | None = None,
    spool: str | os.PathLike[str] | None = None,
    disabled: bool | None = None,
    tags: dict[str, str] | None = None,
    loader: Any = None,
    metadata: dict[str, Any] | None = None,
    skip_first: int = 10,
    wait: int = 0,
    warmup: int = 2,
    active: int = 3,
    repeat: int | None = None,
    every: int | None = None,
    schedule: Callable[[int], Any] | None = None,
    activities: Any = None,
    profile_memory: bool = True,
    record_shapes: bool = True,
    with_stack: bool = False,
    profiler_kwargs: dict[str, Any] | None = None,
    flush_timeout: float | None = None,
    http_timeout: float = 30.0,
    backoff_base: float = 1.0,
    backoff_max: float = 60.0,
    compresslevel: int = 1,
    spool_max_bytes: int | None = None,
    series: bool | None = None,
    anomaly_capture: bool | None = None,
    anomaly_k: float | None = None,
    anomaly_interval: float | None = None,
    series_settings: _series.SeriesSettings | None = None,
    on_demand: bool | None = None,
    on_demand_interval: float | None = None,
    memory_snapshot: bool = False,
    memory_timeline: bool = False,
) -> Profile | NoopProfile:
    """Profile a training loop; call ``prof.step()`` once per step.

    Captures ``active`` steps after ``skip_first`` + ``wait`` + ``warmup`` steps, ``repeat`` times
    (or one window every ``every`` steps). Without a server, traces stay in the spool directory in
    TensorBoard's layout. Any torch.profiler option goes through ``profiler_kwargs``. Returns a
    no-op object with the same API when disabled (``STEPDOCTOR_DISABLED=1``) or torch is missing.
    ``loader`` is a DataLoader or a mapping of its settings; ``metadata`` adds JSON-serialisable
    fields to every trace's metadata (integrations record their trainer's settings there).
    ``spool_max_bytes`` (default ``$STEPDOCTOR_SPOOL_MAX_BYTES`` or 1 GiB) caps the spool; only
    local copies of uploaded traces are ever deleted for it.

    Every step is timed (wall, DataLoader wait, memory) into a step series beside the traces
    (``series=False`` or ``STEPDOCTOR_SERIES=0`` turns it off). A step slower than ``anomaly_k``
    (1.5) times the rolling median of the last 50 steps captures the next window, at most once per
    ``anomaly_interval`` seconds (600); ``anomaly_capture=False`` or ``STEPDOCTOR_ANOMALY_CAPTURE=0``
    turns that off. ``series_settings`` sets every knob at once (tests, benchmarks).

    With a server, a live run's "Capture now" button on the dashboard reaches the loop: a
    background thread asks the server for requests at most every ``on_demand_interval``
    seconds (``STEPDOCTOR_CAPTURE_POLL_S``, 30), backing off on errors, while profiling runs, and
    the next window is captured with ``capture.reason = "on_demand"`` in its metadata.
    ``on_demand=False`` or ``STEPDOCTOR_CAPTURE_ON_DEMAND=0`` turns that off.

    ``memory_snapshot=True`` records the CUDA allocator's history (every allocation and free with
    its stack) during each window and writes it beside the trace, in
    ``SPOOL/<project>/<run>/memory_snapshots/``, for https://pytorch.org/memory_viz. Off by default:
    recording costs a stack capture per allocation inside the window and tens of MB per window
    (``stepdoctor.memory_snapshot``); a no-op without CUDA.

    ``memory_timeline=True`` adds torch's memory timeline of each window (bytes by torch's own
    categories: parameters, optimizer state, inputs, temporaries, activations, gradients) to its
    trace, which the engine then uses instead of inferring the categories. Off by default: it turns
    on ``profile_memory``, ``record_shapes`` and ``with_stack`` and costs Python on the training thread
    at each window's end (0.5 s for 3 steps of a small MLP; more with more ops and tensors)
    (``stepdoctor.memory_timeline``).
    """
    try:
        if flush_timeout is None:
            flush_timeout = _config.default_flush_timeout()
        if spool_max_bytes is None:
            spool_max_bytes = _config.default_spool_max_bytes()
        cfg = _config.resolve(
            project=project,
            run=run,
            server=server,
            token=token,
            spool=spool,
            disabled=disabled,
            tags=tags,
            schedule=_config.Schedule(skip_first, wait, warmup, active, repeat, every),
            delivery=_config.Delivery(
                flush_timeout=flush_timeout,
                http_timeout=http_timeout,
                backoff_base=backoff_base,
                backoff_max=backoff_max,
                compresslevel=compresslevel,
                spool_max_bytes=spool_max_bytes,
            ),
        )
        if series_settings is None:
            series_settings = _series.settings_from_env(
                enabled=series,
                anomaly_capture=anomaly_capture,
                anomaly_k=anomaly_k,
                anomaly_interval=anomaly_interval,
            )
        on_demand_interval = _on_demand.settings_from_env(on_demand, on_demand_interval)
        if cfg.disabled:
            return NoopProfile()
        import torch.profiler  # noqa: F401 - a missing torch means a no-op agent, not a crash
    except ImportError as exc:
        log_once("no-torch", logging.WARNING, "stepdoctor: torch unavailable (%s); profiling disabled", exc)
        return NoopProfile()
    except Exception as exc:
        if raise_errors():
            raise
        log_once(
            "bad-config", logging.WARNING, "stepdoctor: invalid configuration (%s); profiling disabled", exc
        )
        return NoopProfile()
    return Profile(
        cfg,
        loader=loader,
        metadata=metadata,
        activities=activities,
        profile_memory=profile_memory or memory_timeline,  # torch's timeline needs all three
        record_shapes=record_shapes or memory_timeline,
        with_stack=with_stack or memory_timeline,
        schedule=schedule,
        profiler_kwargs=profiler_kwargs,
        series=series_settings,
        on_demand_interval=on_demand_interval,
        memory_snapshot=memory_snapshot,
        memory_timeline=memory_timeline,
    )


@atexit.register
def _stop_all() -> None:
    """Flush sessions the program never stopped (no ``with`` block), within their time budgets.
    After an uncaught exception (the interpreter sets ``sys.last_value`` before exit handlers run)
    the series says the loop did not end cleanly."""
    clean = getattr(sys, "last_value", None) is None
    for prof in list(_live):
        prof.stop(clean=clean)


def _clean_exit(error: object) -> bool:
    """Whether leaving ``with profile(...)`` with this exception ends the loop cleanly: none, or
    ``sys.exit(0)``; anything else (Ctrl-C included) is not."""
    return error is None or (isinstance(error, SystemExit) and error.code in (None, 0))
