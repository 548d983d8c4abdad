"""The verdict in the experiment tracker the training script already uses (W&B, MLflow).

When ``wandb`` or ``mlflow`` is imported by the training process and has an active run when the
session starts, each window the server has analysed is logged into that run once: the run's
verdict (the limiting kind), its share of the step, the gain, the first card, a link to the run's
page, and the step-time summary of the analysed steps (mean, p50, p90, max, count). Nothing is
imported here that the process did not import itself (``sys.modules``), so with neither installed
or active this is off and costs nothing.

Work stays off the training thread: a daemon thread polls the server (``/api/v1/runs``,
``/runs/{id}/traces``, ``/runs/{id}/diagnosis``, ``/traces/{id}/report``) every ``interval``
seconds, and at the end of training a last pass waits, at most ``timeout`` seconds, for the
windows just delivered. The run is the tracker's run captured on the training thread (MLflow's
active run is per thread); W&B's values go into the run's summary (the latest window's), MLflow's
as metrics at step = window count and tags. Every failure (no server, a token that may not read,
a tracker that refuses a value) is logged once and never reaches training.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stepdoctor.guard import guarded, log_once

logger = logging.getLogger("stepdoctor")
PREFIX = "stepdoctor"
HTTP_TIMEOUT_S = 10.0


@dataclass
class Sinks:
    """The trackers' active runs, captured on the training thread."""

    wandb_run: Any = None
    mlflow_run_id: str | None = None

    def __bool__(self) -> bool:
        return self.wandb_run is not None or self.mlflow_run_id is not None


def active_sinks() -> Sinks:
    """The W&B and MLflow runs active in this process; never imports either."""
    sinks = Sinks()
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        sinks.wandb_run = wandb.run
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and hasattr(mlflow, "active_run"):
        run = mlflow.active_run()
        if run is not None:
            sinks.mlflow_run_id = run.info.run_id
    return sinks


def step_summary(durations_us: list[float]) -> dict[str, float]:
    """The step-time series of the analysed steps, in ms."""
    if not durations_us:
        return {}
    ms = sorted(d / 1e3 for d in durations_us)
    p90 = ms[min(len(ms) - 1, round(0.9 * (len(ms) - 1)))]
    return {
        "step_time_ms_mean": round(statistics.fmean(ms), 4),
        "step_time_ms_p50": round(statistics.median(ms), 4),
        "step_time_ms_p90": round(p90, 4),
        "step_time_ms_max": round(ms[-1], 4),
        "steps": float(len(ms)),
    }


def verdict_record(server: str, run_id: int, diagnosis: Mapping[str, Any]) -> dict[str, Any]:
    """What is logged about the run's verdict (read from the server's run diagnosis)."""
    primary = diagnosis.get("primary") or {}
    cards = diagnosis.get("recommendations") or []
    first = cards[0] if cards else {}
    return {
        "verdict": primary.get("kind"),
        "share": primary.get("share"),
        "gain": primary.get("gain"),
        "first_card": first.get("title"),
        "first_card_id": first.get("id"),
        "run_page": f"{server}/runs/{run_id}",
    }


@dataclass
class Reporter:
    """Polls the server for newly analysed windows of one run and logs each into the sinks once."""

    server: str
    token: str | None
    project: str
    run: str
    sinks: Sinks
    interval: float = 30.0
    delivered: Any = None  # () -> how many windows the agent has delivered so far
    run_id: int | None = None
    logged: set[int] = field(default_factory=set)
    durations_us: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # one pass at a time: each window once
    _thread: threading.Thread | None = None
    _dead: bool = False  # the server refused us for good (a token that may not read)

    def start(self) -> Reporter:
        self.server = self.server.rstrip("/")
        self._thread = threading.Thread(target=self._loop, name="stepdoctor-trackers", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    @guarded()
    def close(self, timeout: float) -> None:
        """Stop polling; wait up to ``timeout`` s for the delivered windows to be analysed and logged."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HTTP_TIMEOUT_S)
        deadline = time.monotonic() + timeout
        while not self._dead:
            self.poll()
            wanted = self.delivered() if self.delivered is not None else 0
            if len(self.logged) >= wanted or time.monotonic() >= deadline:
                break
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    @guarded()
    def poll(self) -> None:
        """One pass: log every window analysed since the last pass."""
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        if self._dead:
            return
        if self.run_id is None:
            self.run_id = self._find_run()
            if self.run_id is None:
                return
        traces = self._get(f"/runs/{self.run_id}/traces", limit=200).get("items", [])
        done = [t for t in traces if t.get("status") == "done"]
        new = [t for t in done if t["id"] not in self.logged]
        if not new:
            return
        diagnosis = self._get(f"/runs/{self.run_id}/diagnosis").get("diagnosis") or {}
        if (diagnosis.get("traces") or 0) < len(done):
            return  # the run's verdict does not include the new windows yet: the next pass logs them
        verdict = verdict_record(self.server, self.run_id, diagnosis)
        for trace in sorted(new, key=lambda t: t["id"]):
            report = self._get(f"/traces/{trace['id']}/report").get("report") or {}
            self.durations_us += [float(s.get("duration_us") or 0.0) for s in report.get("steps") or []]
            self.logged.add(trace["id"])
            self._log(verdict | step_summary(self.durations_us) | {"windows": float(len(self.logged))})

    def _find_run(self) -> int | None:
        runs = self._get("/runs", project=self.project, limit=200).get("items", [])
        return next((r["id"] for r in runs if r.get("name") == self.run), None)

    def _get(self, path: str, **params: Any) -> dict[str, Any]:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        request = urllib.request.Request(f"{self.server}/api/v1{path}{query}")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                answer: dict[str, Any] = json.loads(response.read().decode("utf-8"))
                return answer
        except urllib.error.HTTPError as exc:
            if exc.code in (404, 409):
                return {}  # the run or its verdict is not there yet: the next pass asks again
            if exc.code not in (401, 403):
                raise
            self._dead = True  # the token may not read: asking again would not change that
            log_once(
                f"trackers:{exc.code}",
                logging.WARNING,
                "stepdoctor: the server refused to show the verdict (HTTP %s); it is not logged to "
                "W&B/MLflow: pass read_token= (a read or admin token) to the callback",
                exc.code,
            )
            return {}

    def _log(self, record: Mapping[str, Any]) -> None:
        numbers = {
            k: float(v) for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)
        }
        texts = {k: str(v) for k, v in record.items() if isinstance(v, str)}
        if self.sinks.wandb_run is not None:
            self.sinks.wandb_run.summary.update({f"{PREFIX}/{k}": v for k, v in (numbers | texts).items()})
        if self.sinks.mlflow_run_id is not None:
            from mlflow.tracking import MlflowClient  # the process imported mlflow already

            client, run_id, step = MlflowClient(), self.sinks.mlflow_run_id, int(numbers["windows"])
            for key, value in numbers.items():
                client.log_metric(run_id, f"{PREFIX}.{key}", value, step=step)
            for key, text in texts.items():
                client.set_tag(run_id, f"{PREFIX}.{key}", text)


def start_reporter(prof: Any, *, read_token: str | None, interval: float) -> Reporter | None:
    """A running reporter for ``prof``'s run when a tracker is active and a server is configured."""
    config = getattr(prof, "config", None)
    if config is None or not config.server:
        return None
    sinks = active_sinks()
    if not sinks:
        return None
    return Reporter(
        server=config.server,
        token=read_token or config.token,
        project=config.project,
        run=config.run,
        sinks=sinks,
        interval=interval,
        delivered=lambda: prof.stats.delivered,
    ).start()
