"""The regression webhook's sender: rows of ``webhook_deliveries`` POSTed off the request path.

``runs.regressions`` queues one row per new regression (unique per run and signature, so a
recomputation with the same outcome never queues a second). Whichever worker is idle claims a
due row and POSTs its JSON payload to ``STEPDOCTOR_WEBHOOK_URL``: a 2xx marks it delivered; a
timeout, connection error, 5xx, 408 or 429 schedules another try after an exponentially growing
wait (``webhook_retry_wait_s`` × 2^(tries-1), at most an hour), ``webhook_tries`` tries in all;
another 4xx (the receiver refuses the payload) fails it at once. A row is sent by one worker at
a time (the claim), and marked delivered right after its 2xx: only a worker killed between the
two sends it twice.

Registered with the job engine (``jobs.defer``): ``WEBHOOKS`` for procrastinate's periodic drain
and a claimer for the embedded pool; and ``regressions.recheck_series_now`` as a sweep (a run's
status redone when its step series changed). The URL is a secret: logs show its scheme and host only.
"""

from __future__ import annotations

import http.client
import json
import logging
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any

from sqlalchemy import or_, select, update

from stepdoctor_server.core.database import Database
from stepdoctor_server.core.models import WebhookDelivery, utcnow
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.jobs.defer import CLAIMERS, SWEEPS, WEBHOOKS, JobContext, handles
from stepdoctor_server.jobs.pool import retry_db
from stepdoctor_server.runs.regressions import recheck_series_now

log = logging.getLogger("stepdoctor.webhook")
MAX_WAIT_S = 3600.0
RETRY_STATUSES = frozenset({408, 425, 429})


def retry_after_s(settings: Settings, tries: int) -> float:
    """The wait after the ``tries``-th failed try (1-based)."""
    return float(min(MAX_WAIT_S, settings.webhook_retry_wait_s * 2 ** (tries - 1)))


def _stale_claim_s(settings: Settings) -> float:
    """A claim older than this belongs to a worker that died mid-POST: the row is due again."""
    return 2 * settings.webhook_timeout_s + 60.0


def claim(db: Database, settings: Settings, worker_id: str) -> tuple[int, dict[str, Any], int] | None:
    """(id, payload, try number) of one due delivery, claimed for ``worker_id``; None when none is due.

    Portable optimistic claim: the UPDATE only wins while the row is still unclaimed (or its claim
    is stale), so two workers never POST one row at once, on SQLite or PostgreSQL.
    """
    now = utcnow()
    stale = now - timedelta(seconds=_stale_claim_s(settings))
    due = (
        (WebhookDelivery.status == "pending")
        & (WebhookDelivery.next_attempt_at <= now)
        & or_(WebhookDelivery.claimed_at.is_(None), WebhookDelivery.claimed_at < stale)
    )
    with db.session() as session:
        for row_id in session.scalars(
            select(WebhookDelivery.id).where(due).order_by(WebhookDelivery.next_attempt_at).limit(5)
        ):
            won = session.execute(
                update(WebhookDelivery)
                .where(WebhookDelivery.id == row_id, due)
                .values(
                    claimed_by=worker_id,
                    claimed_at=now,
                    attempts=WebhookDelivery.attempts + 1,
                    updated_at=now,
                )
                .execution_options(synchronize_session=False)
            )
            if won.rowcount == 1:  # type: ignore[attr-defined]
                row = session.execute(
                    select(WebhookDelivery.payload, WebhookDelivery.attempts).where(
                        WebhookDelivery.id == row_id
                    )
                ).one()
                return row_id, dict(row.payload), int(row.attempts)
    return None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, not a delivery: it is never followed (the body is not re-sent)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def post(settings: Settings, payload: dict[str, Any]) -> tuple[bool, bool, str]:
    """(delivered, worth retrying, what happened) for one POST of ``payload``; TLS is verified.

    The standard library's client, which logs nothing (httpx logs every request's full URL, and
    the URL is the secret)."""
    request = urllib.request.Request(
        settings.webhook_url.get_secret_value(),
        data=json.dumps(payload).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "User-Agent": "stepdoctor-webhook"},
    )
    try:
        with _OPENER.open(request, timeout=settings.webhook_timeout_s) as response:
            response.read(65536)
            code = int(response.status)
    except urllib.error.HTTPError as exc:
        code = int(exc.code)
        exc.close()
    except TimeoutError:
        return False, True, "timed out"
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # refused, DNS, TLS
        reason = getattr(exc, "reason", exc)
        return False, True, "timed out" if isinstance(reason, TimeoutError) else type(reason).__name__
    if 200 <= code < 300:
        return True, False, f"HTTP {code}"
    return False, code >= 500 or code in RETRY_STATUSES, f"HTTP {code}"


def process_one_webhook(db: Database, settings: Settings, worker_id: str) -> bool:
    """Send one due delivery; False when none was due (or no webhook URL is set)."""
    if not settings.webhook_url.get_secret_value():
        return False
    claimed = retry_db(lambda: claim(db, settings, worker_id), what="webhook claim")
    if claimed is None:
        return False
    row_id, payload, tries = claimed
    delivered, retry, what = post(settings, payload)
    now = utcnow()
    if delivered:
        values: dict[str, Any] = {"status": "delivered", "delivered_at": now, "last_error": None}
        log.info("webhook %s: delivered to %s (try %d)", row_id, settings.webhook_url_shown, tries)
    elif retry and tries < settings.webhook_tries:
        wait = retry_after_s(settings, tries)
        values = {"next_attempt_at": now + timedelta(seconds=wait), "last_error": what}
        log.warning(
            "webhook %s: %s from %s (try %d of %d); retrying in %.0f s",
            row_id,
            what,
            settings.webhook_url_shown,
            tries,
            settings.webhook_tries,
            wait,
        )
    else:
        values = {"status": "failed", "last_error": what}
        log.warning(
            "webhook %s: %s from %s; given up after %d try(s)",
            row_id,
            what,
            settings.webhook_url_shown,
            tries,
        )

    def finish() -> None:
        with db.session() as session:
            session.execute(
                update(WebhookDelivery)
                .where(WebhookDelivery.id == row_id, WebhookDelivery.claimed_by == worker_id)
                .values(claimed_by=None, claimed_at=None, updated_at=now, **values)
                .execution_options(synchronize_session=False)
            )

    retry_db(finish, what=f"webhook {row_id}")
    return True


@handles(WEBHOOKS)
def drain_webhooks(runtime: Any) -> None:
    """Body of procrastinate's periodic ``webhooks``: send every due delivery."""
    while process_one_webhook(runtime.db, runtime.settings, runtime.worker_id):
        pass


def claim_webhook(job: JobContext) -> bool:
    """The embedded pool's claimer for webhook deliveries."""
    return process_one_webhook(job.db, job.settings, job.worker_id)


CLAIMERS.append(claim_webhook)
# A run's series changes without a new diagnosis: the sweep redoes its status (and may queue a webhook).
SWEEPS.append(recheck_series_now)
