"""Webhook notifications: the scheduler process's sender, which never holds up a tick.

The transition script adds an entry to the Redis outbox (``keys.notify_outbox``) in the same atomic step that
moves a job with ``notify`` into one of its ``on`` states. A background thread reads the outbox after its
cursor (kept in Redis), takes each entry with an HSETNX marker per job and state change (so a restarted
scheduler never sends one twice: at most once), and hands the POST to a small thread pool: a receiver that
hangs holds one pool thread for at most ``attempts x timeout``, never the scheduling loop. Each send first checks
where the host resolves now and connects to exactly that address (``service.rules.webhooks.target``: no second
resolution for a DNS rebinding to slip into); a failure is told to the job in generic words.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx

from api_schemas import keys
from api_schemas.notify import SIGNATURE_HEADER, WebhookPayload, webhook_host
from service.core.settings import Settings
from service.core.store import Store
from service.rules import webhooks as webhook_guard

log = logging.getLogger("tlab.notify")
BATCH = 100  # outbox entries read at once
RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})  # worth another try; any other 4xx is final


def sign(secret: str, body: bytes) -> str:
    """``sha256=<hex>``: HMAC-SHA256 of the raw body with the owner's secret (the X-Tlab-Signature value)."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def job_link(settings: Settings, kind: str, job_id: str) -> str:
    """The job's API URL: ``TLAB_PUBLIC_URL`` (or the API's own address) + its route."""
    base = (settings.public_url or f"http://{settings.bind}:{settings.port}").rstrip("/")
    return f"{base}/v1/{'sweeps' if kind == 'sweep' else 'experiments'}/{job_id}"


class Sender:
    """Drains the outbox into signed POSTs: ``start()`` a thread, or call ``drain()`` (tests)."""

    def __init__(self, store: Store, settings: Settings, workers: int = 4, backoff_s: float = 1.0) -> None:
        self.store, self.settings, self.backoff_s = store, settings, backoff_s
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tlab-webhook")
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    # ---- taking entries from the outbox ---------------------------------------------------
    def drain(self, block_ms: int | None = None) -> list[Future[bool]]:
        """Take the outbox entries after the cursor and queue their POSTs; returns their futures."""
        cursor = self.store.r.get(keys.notify_cursor()) or "0-0"
        got = self.store.r.xread({keys.notify_outbox(): cursor}, count=BATCH, block=block_ms)
        futures = []
        for _stream, entries in got or []:
            for entry_id, fields in entries:
                try:
                    future = self.take(fields)
                except (KeyError, ValueError):  # a malformed entry or job hash: skip it, never stall on it
                    log.exception("webhook outbox entry %s", entry_id)
                    future = None
                if future is not None:
                    futures.append(future)
                self.store.r.set(keys.notify_cursor(), entry_id)
        return futures

    def take(self, entry: dict[str, str]) -> Future[bool] | None:
        """Mark the entry's state change as taken (HSETNX: only the first taker sends) and queue its POST."""
        job_id, state = entry["job"], entry["state"]
        marker = f"{state}:{entry.get('attempt', '0')}"
        if not self.store.r.hsetnx(keys.notified(job_id), marker, json.dumps({"taken_at": time.time()})):
            return None
        data = self.store.r.hgetall(keys.job(job_id))
        if not data.get("notify"):
            return None
        url = json.loads(data["notify"])["webhook"]
        if why := webhook_guard.refusal(self.settings, url, unresolved_ok=False):
            self.note(job_id, marker, f"webhook not sent: {why}")
            return None
        kind = data.get("kind", "experiment")
        payload = WebhookPayload(
            id=job_id, name=data.get("name", job_id), owner=data["owner"], kind=kind, state=state,
            reason=data.get("failure_reason") or entry.get("reason", ""),
            summary=json.loads(data["summary"]) if data.get("summary") else None,
            link=job_link(self.settings, kind, job_id))
        body = payload.model_dump_json().encode()
        signature = sign(self.store.webhook_secret(data["owner"]), body)
        return self.pool.submit(self.post, job_id, marker, url, body, signature)

    # ---- sending --------------------------------------------------------------------------
    def post(self, job_id: str, marker: str, url: str, body: bytes, signature: str) -> bool:
        """POST with a timeout, ``TLAB_WEBHOOK_ATTEMPTS`` tries with doubling backoff; the outcome goes on the
        marker, and a failure also into the job's log."""
        headers = {"Content-Type": "application/json", SIGNATURE_HEADER: signature,
                   "User-Agent": "teleport-lab-webhook"}
        error = ""
        for attempt in range(self.settings.webhook_attempts):
            if attempt:
                if self.stopping.wait(self.backoff_s * 2 ** (attempt - 1)):
                    break
            to = webhook_guard.target(self.settings, url)  # its address now, and the connection goes there
            if isinstance(to, str):
                self.note(job_id, marker, f"webhook not sent: {to}")
                return False
            try:
                with httpx.Client(timeout=self.settings.webhook_timeout_s) as client:
                    r = client.post(to.url, content=body, headers=headers | to.headers, extensions=to.extensions)
            except httpx.HTTPError as err:
                error = f"{type(err).__name__}: {err}"
                continue
            if r.is_success:
                self.store.r.hset(keys.notified(job_id), marker, json.dumps({"sent_at": time.time(),
                                                                             "status": r.status_code}))
                return True
            error = f"HTTP {r.status_code}"
            if r.status_code not in RETRY_STATUS:
                break
        self.note(job_id, marker, f"webhook to {webhook_host(url)} failed after {attempt + 1} tries: no 2xx answer",
                  detail=error)
        return False

    def note(self, job_id: str, marker: str, message: str, detail: str = "") -> None:
        """A webhook not sent: ``message`` (generic: no port, status or error text that would tell what answers
        where) on its marker and in the job's log; ``detail`` in this process's log only."""
        log.warning("%s: %s%s", job_id, message, f" ({detail})" if detail else "")
        self.store.r.hset(keys.notified(job_id), marker, json.dumps({"failed_at": time.time(), "error": message}))
        self.store.log_event(job_id, "warning", message)

    # ---- the thread -----------------------------------------------------------------------
    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.drain(block_ms=1000)
            except Exception:  # Redis away or a bad entry: log, wait, go on (the cursor stays)
                log.exception("webhook sender")
                self.stopping.wait(1.0)

    def start(self) -> Sender:
        self.thread = threading.Thread(target=self.run, name="tlab-webhook-sender", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        self.pool.shutdown(wait=False, cancel_futures=True)
