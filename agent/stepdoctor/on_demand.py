"""Capture on demand: a background thread asks the server whether someone clicked "Capture now".

While a profile with a server runs (``Profile.start`` to ``Profile.stop``), one daemon thread polls
``GET /api/v1/capture-requests?project=&run=`` at most every ``interval`` seconds (30 by default),
backing off exponentially on errors (``Retry-After`` honoured), and never touches the training
thread beyond handing a request over (``on_request``: the profiler captures its next window with
``capture.reason = "on_demand"``). When that window is in the spool the profiler calls
:meth:`DemandPoller.captured`, and the thread acknowledges the request with the window's
Idempotency-Key (the server finds the trace by it when the upload arrives).

Every request is bounded (connect and socket timeouts); at exit :meth:`DemandPoller.close` gives the
thread a small budget to send a last acknowledgement and then leaves it (a daemon). A server that
does not know the endpoint (404, 405, 501) or refuses the token (401/403) ends polling, logged once
(not on stderr: the exit line stays the agent's one line); the run goes on without capture on
demand. Standard library only.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import stepdoctor.transport as transport
from stepdoctor.guard import guarded, log_once
from stepdoctor.version import __version__

#: Default seconds between two polls (``STEPDOCTOR_CAPTURE_POLL_S``): the most it asks of a server.
POLL_INTERVAL_S = 30.0
#: The longest wait between polls while the server keeps failing.
BACKOFF_MAX_S = 600.0
#: Each poll or acknowledgement: connect and per-operation socket timeout, in seconds.
REQUEST_TIMEOUT_S = 10.0
_OFF = ("0", "false", "off", "no")
#: Answers that end polling: the token may not poll, or the server has no such endpoint.
_UNSUPPORTED = (401, 403, 404, 405, 501)
#: Most tries of one acknowledgement before it is given up (the request then stays pending).
ACK_TRIES = 5


@dataclass(frozen=True)
class Demand:
    """A pending request from the server: its id and when it was made (as the server wrote it)."""

    id: int
    requested_at: str | None


@dataclass(frozen=True)
class _Answer:
    status: int | None  # None: no answer (connection refused, timeout)
    body: Any
    retry_after: float | None
    error: str


def settings_from_env(enabled: bool | None, interval: float | None) -> float | None:
    """The poll interval, or None when capture on demand is off. Arguments win, then
    ``STEPDOCTOR_CAPTURE_ON_DEMAND=0`` (off) and ``STEPDOCTOR_CAPTURE_POLL_S``, then 30 s."""
    env = os.environ
    if enabled is None:
        enabled = env.get("STEPDOCTOR_CAPTURE_ON_DEMAND", "").strip().lower() not in _OFF
    if interval is None:
        text = env.get("STEPDOCTOR_CAPTURE_POLL_S", "").strip()
        interval = float(text) if text else POLL_INTERVAL_S
    if not 0 < interval < float("inf"):
        raise ValueError(f"the capture poll interval must be a positive number of seconds, not {interval!r}")
    return interval if enabled else None


class DemandPoller:
    """The polling thread of one profile (one process): poll, hand over, acknowledge."""

    def __init__(
        self,
        server: str,
        token: str | None,
        project: str,
        run: str,
        rank: int | None,
        on_request: Callable[[Demand], bool],
        *,
        interval: float = POLL_INTERVAL_S,
        backoff_max: float = BACKOFF_MAX_S,
        retry_after_max: float = 3600.0,
        timeout: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.server, self.token, self.project, self.run, self.rank = server, token, project, run, rank
        self.on_request = on_request
        self.interval = interval
        self.backoff_max = max(backoff_max, interval)
        self.retry_after_max = retry_after_max
        self.timeout = timeout
        self.polls = 0  # requests made (tests, the exit line)
        self.failures = 0  # consecutive failed polls
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._stopping = False
        self._in_flight: int | None = None  # a request handed over, not yet acknowledged
        self._acks: list[tuple[int, dict[str, Any], int]] = []  # (request id, body, tries)
        self._thread: threading.Thread | None = None

    # --- called from the training thread ------------------------------------------------------

    @guarded()
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stepdoctor-on-demand", daemon=True)
        self._thread.start()

    @guarded()
    def captured(self, request_id: int, trace_key: str | None, detail: str | None = None) -> None:
        """The requested window is in the spool (``trace_key``) or was lost (``detail``): acknowledge
        it from the thread. Never blocks."""
        if os.getpid() != self._pid:
            return
        body: dict[str, Any] = {"rank": self.rank}
        if trace_key is not None:
            body["trace_key"] = trace_key
        else:
            body["detail"] = (detail or "the window could not be captured")[:500]
        with self._cond:
            self._acks.append((request_id, body, 0))
            self._cond.notify_all()

    @guarded()
    def close(self, timeout: float) -> None:
        """Stop polling; a queued acknowledgement gets up to ``timeout`` s, then the thread is left."""
        if os.getpid() != self._pid or self._thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(max(0.0, timeout))

    # --- the thread ---------------------------------------------------------------------------

    @guarded()
    def _run(self) -> None:
        next_poll = time.monotonic()  # the first poll at start: a request may already be waiting
        acks_at = 0.0  # failed acknowledgements are tried again from then
        while True:
            with self._cond:
                while not self._stopping:
                    now = time.monotonic()
                    if self._acks and now >= acks_at:
                        break
                    if self._in_flight is None and now >= next_poll:
                        break
                    due = [
                        t
                        for t, on in ((next_poll, self._in_flight is None), (acks_at, bool(self._acks)))
                        if on
                    ]
                    self._cond.wait(max(0.0, min(due) - now) if due else None)
                acks, self._acks = self._acks, []
                stopping = self._stopping
            again = [
                (rid, body, tries + 1) for rid, body, tries in acks if not self._acknowledge(rid, body, tries)
            ]
            if again:
                with self._cond:
                    self._acks[:0] = again
                acks_at = time.monotonic() + min(self.backoff_max, self.interval * 2 ** again[0][2])
            if stopping:
                return
            if self._in_flight is None and time.monotonic() >= next_poll:
                delay = self._poll_once()
                if delay is None:
                    return  # the server cannot serve capture on demand: stop asking
                next_poll = time.monotonic() + delay

    @guarded(default=None)
    def _poll_once(self) -> float | None:
        """One poll; the delay before the next (None: stop polling for good)."""
        query = urllib.parse.urlencode({"project": self.project, "run": self.run})
        self.polls += 1
        answer = self._request("GET", f"/api/v1/capture-requests?{query}", None)
        if answer.status == 200 and isinstance(answer.body, dict):
            self.failures = 0
            found = [r for r in answer.body.get("requests") or [] if isinstance(r, dict)]
            if found and isinstance(found[0].get("id"), int):
                self._hand_over(Demand(found[0]["id"], found[0].get("requested_at")))
            return self.interval
        if answer.status in _UNSUPPORTED:
            log_once(
                f"on-demand-off:{self.server}",
                logging.INFO,
                "stepdoctor: capture on demand is off for this run: %s answered the poll with %s "
                "(it needs a server with /api/v1/capture-requests and an upload token)",
                self.server,
                answer.error,
            )
            return None
        self.failures += 1
        delay = min(self.backoff_max, self.interval * 2**self.failures) * random.uniform(1.0, 1.25)
        if answer.retry_after is not None:
            delay = max(delay, min(answer.retry_after, self.retry_after_max))
        return max(self.interval, delay)

    def _hand_over(self, demand: Demand) -> None:
        self._in_flight = demand.id
        taken = False
        try:
            taken = bool(self.on_request(demand))
        finally:
            if not taken:
                self._in_flight = None
                self.captured(demand.id, None, "the profiler was not running")

    def _acknowledge(self, request_id: int, body: dict[str, Any], tries: int) -> bool:
        """Send one acknowledgement; False when it should be tried again (no answer, or 5xx/429).
        Given up after ``ACK_TRIES`` (the request stays pending, and polling resumes)."""
        answer = self._request("POST", f"/api/v1/capture-requests/{request_id}/ack", body)
        status = answer.status
        done = status is not None and status < 500 and status != 429
        if done or tries + 1 >= ACK_TRIES:
            if self._in_flight == request_id:
                self._in_flight = None
            return True
        return False

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> _Answer:
        """One small JSON request under the connect and socket timeouts; never raises for network trouble."""
        url = urllib.parse.urlsplit(self.server)
        if url.scheme not in ("http", "https") or not url.hostname:
            return _Answer(404, None, None, f"invalid server URL {self.server!r}")
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"User-Agent": f"stepdoctor-agent/{__version__}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            conn, target, extra = transport.connection(url, self.timeout)
        except (OSError, ValueError) as exc:
            return _Answer(None, None, None, f"{type(exc).__name__}: {exc}")
        headers.update(extra)
        try:
            conn.request(method, target + url.path.rstrip("/") + path, body=data, headers=headers)
            response = conn.getresponse()
            raw = response.read(64 * 1024)
            status = response.status
            retry_after = transport.parse_retry_after(response.getheader("Retry-After"))
        except (OSError, ValueError, http.client.HTTPException) as exc:
            return _Answer(None, None, None, f"{type(exc).__name__}: {exc}")
        finally:
            conn.close()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        return _Answer(status, parsed, retry_after, f"HTTP {status}")
