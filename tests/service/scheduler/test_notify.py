"""Webhooks: only http(s) and allowed hosts at submit; a signed POST per state change that a job's ``notify.on``
names, at most once even when the sender restarts; a receiver that hangs or fails holds up nothing else
(API + real Redis and a real HTTP receiver on loopback; the scheduler's sender driven directly)."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from api_schemas import keys
from api_schemas.jobs import JobState
from service.core.settings import Settings
from service.core.store import Store
from service.scheduler.notify import Sender
from tests.service.conftest import Api, tiny

ALLOWED = "127.0.0.1,hooks.example.org"


class Receiver:
    """A webhook receiver on loopback: records each POST (headers, raw body); answers ``status``, or first
    waits until ``release`` is set when ``hang`` is true."""

    def __init__(self, status: int = 200, hang: bool = False) -> None:
        self.posts: list[tuple[dict[str, str], bytes]] = []
        self.arrived = threading.Condition()
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.arrived:
                    receiver.posts.append((dict(self.headers), body))
                    receiver.arrived.notify_all()
                if hang:
                    receiver.release.wait(60)
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, count: int, timeout_s: float = 30) -> list[dict[str, Any]]:
        """The first ``count`` payloads, once they have arrived (fails after ``timeout_s``)."""
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.posts) >= count, timeout_s), f"{len(self.posts)} POSTs"
        return [json.loads(body) for _h, body in self.posts[:count]]

    def verify(self, secret: str) -> None:
        """Every POST's X-Tlab-Signature is the HMAC-SHA256 of its raw body with ``secret``."""
        for headers, body in self.posts:
            expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
            assert hmac.compare_digest(headers["X-Tlab-Signature"], expected)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def api_env() -> dict[str, str]:
    return {"TLAB_WEBHOOK_ALLOW": ALLOWED, "TLAB_PUBLIC_URL": "https://lab.example.org/"}


@pytest.fixture()
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for r in made:
        r.close()


def sender(api: Api, **kw: Any) -> Sender:
    settings = Settings(redis_url=api.stack.redis_url or "", webhook_allow=ALLOWED,
                        public_url="https://lab.example.org/", webhook_timeout_s=2.0)
    return Sender(Store.from_url(settings.redis_url), settings, **kw)


def submit(api: Api, user: str, webhook: str, **notify: Any) -> str:
    with api.client(user) as c:
        r = c.post("/v1/experiments", json={"spec": tiny(), "name": "n", "notify": {"webhook": webhook, **notify}})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])


def secret_of(api: Api, user: str) -> str:
    with api.client(user) as c:
        return str(c.get("/v1/me/webhook-secret").json()["secret"])


def test_webhooks_are_http_to_allowed_hosts_only(api_only: Api) -> None:
    with api_only.client() as c:
        for url, words in [("ftp://127.0.0.1/x", "http"), ("file:///etc/passwd", "http"), ("http:///x", "host"),
                           ("http://evil.example.com/x", "TLAB_WEBHOOK_ALLOW")]:
            for path, body in [("/v1/experiments", {"spec": tiny()}),
                               ("/v1/sweeps", {"base": tiny(), "search_space": {"training.seed": {"grid": [0, 1]}}})]:
                r = c.post(path, json={**body, "notify": {"webhook": url}})
                assert r.status_code == 422, r.text
                err = r.json()["errors"][0]
                assert err["field"] == "notify.webhook" and words in err["message"], r.text
        r = c.post("/v1/experiments", json={"spec": tiny(), "notify": {"webhook": "https://HOOKS.example.org/x",
                                                                      "on": ["failed"]}})
        assert r.status_code == 201 and r.json()["notify"]["on"] == ["failed"], r.text
        r = c.post("/v1/experiments", json={"spec": tiny(), "notify": {"webhook": "http://127.0.0.1/x", "on": []}})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "notify.on", r.text
        first, again = c.get("/v1/me/webhook-secret").json(), c.get("/v1/me/webhook-secret").json()
        assert first == again and len(first["secret"]) == 64 and first["header"] == "X-Tlab-Signature"
    api_only.add_user("alice")
    assert secret_of(api_only, "alice") != first["secret"]


def test_signed_posts_for_succeeded_cancelled_and_preempted_once_each(api_only: Api,
                                                                      receivers: list[Receiver]) -> None:
    receivers.append(hook := Receiver())
    api_only.add_user("alice")
    store = Store.from_url(api_only.stack.redis_url or "")
    done = submit(api_only, "alice", hook.url, on=["succeeded"])
    quiet = submit(api_only, "alice", hook.url, on=["succeeded"])
    dropped = submit(api_only, "alice", hook.url)
    with api_only.client("alice") as c:
        assert c.post(f"/v1/experiments/{dropped}/cancel").status_code == 202
        assert c.post(f"/v1/experiments/{quiet}/cancel").status_code == 202  # cancelled is not in its `on`
    for to in (JobState.STARTING, JobState.RUNNING, JobState.SUCCEEDED):
        assert store.transition(done, to, attempts="1", summary={"final_train_loss": 0.5})
    first = sender(api_only)
    assert all(f.result(30) for f in first.drain())
    got = {p["id"]: p for p in hook.wait(2)}
    assert set(got) == {done, dropped}
    hook.verify(secret_of(api_only, "alice"))
    assert got[done] == {"id": done, "name": "n", "owner": "alice", "kind": "experiment", "state": "succeeded",
                         "reason": "", "summary": {"final_train_loss": 0.5},
                         "link": f"https://lab.example.org/v1/experiments/{done}"}
    assert got[dropped]["state"] == "cancelled" and got[dropped]["reason"] == "cancelled by user"
    # a restarted sender that lost its cursor finds the markers: nothing is sent twice
    store.r.delete(keys.notify_cursor())
    assert sender(api_only).drain() == [] and len(hook.posts) == 2
    # preempted: running -> queued, once per attempt
    moved = submit(api_only, "alice", hook.url, on=["preempted"])
    for attempt in ("1", "2"):
        assert store.transition(moved, JobState.STARTING, attempts=attempt)
        assert store.transition(moved, JobState.RUNNING)
        assert store.transition(moved, JobState.QUEUED, reason="its Ray job vanished")
    assert all(f.result(30) for f in first.drain())
    assert [p["state"] for p in hook.wait(4)[2:]] == ["preempted", "preempted"]
    first.stop()


def test_a_hanging_or_failing_receiver_holds_up_nothing(api_only: Api, receivers: list[Receiver]) -> None:
    receivers.extend([hang := Receiver(hang=True), broken := Receiver(status=500), ok := Receiver()])
    api_only.add_user("alice")
    store = Store.from_url(api_only.stack.redis_url or "")
    ids = [submit(api_only, "alice", r.url) for r in (hang, broken, ok)]
    with api_only.client("alice") as c:
        for job in ids:
            assert c.post(f"/v1/experiments/{job}/cancel").status_code == 202
    s = sender(api_only, backoff_s=0.01)
    futures = s.drain()  # returns at once: the POSTs run in the sender's pool
    hang.wait(1)
    assert ok.wait(1)[0]["id"] == ids[2] and not hang.release.is_set()  # sent while the other one hangs
    assert futures[1].result(30) is False and len(broken.posts) == 3  # 500: 3 tries, then given up
    marker = json.loads(store.r.hget(keys.notified(ids[1]), "cancelled:0") or "{}")
    assert marker["error"] == "webhook to 127.0.0.1 failed after 3 tries: no 2xx answer"  # generic: no status
    logs = [json.loads(f["data"]) for _i, f in store.r.xrange(keys.events(ids[1])) if f["kind"] == "log"]
    assert any(e["message"] == marker["error"] for e in logs) and not any("500" in e["message"] for e in logs)
    hang.release.set()
    assert futures[0].result(30) is True
    s.stop()


@pytest.mark.parametrize("api_env", [{}])  # no TLAB_WEBHOOK_ALLOW: any public host, no internal one
def test_webhooks_to_loopback_link_local_or_private_addresses_are_refused_unless_allowed(
    api_only: Api, receivers: list[Receiver]
) -> None:
    """At submit (after DNS resolution: ``localhost`` too) and again at send: a job submitted while the host was
    allowed is not sent to once the admin no longer names it; the job's log says why in one generic line."""
    receivers.append(ok := Receiver())
    with api_only.client() as c:
        for url in (ok.url, "http://localhost:6379/", "http://[::1]/x", "http://169.254.169.254/latest/meta-data",
                    "http://10.1.2.3/x", "http://192.168.0.1/x", "http://[::ffff:127.0.0.1]/x", "http://0.0.0.0/"):
            r = c.post("/v1/experiments", json={"spec": tiny(), "notify": {"webhook": url}})
            assert r.status_code == 422 and r.json()["errors"][0]["field"] == "notify.webhook", (url, r.text)
            assert "TLAB_WEBHOOK_ALLOW" in r.text and "loopback, link-local or private" in r.text, r.text
        r = c.post("/v1/experiments", json={"spec": tiny(), "notify": {"webhook": "https://hooks.example.org/x"}})
        assert r.status_code == 201, r.text  # does not resolve offline: checked again at send
    store = Store.from_url(api_only.stack.redis_url or "")
    url = api_only.stack.redis_url or ""
    first = cancelled_with_webhook(store, ok.url)  # stored as if 127.0.0.1 had been allowed at its submit
    refused = Sender(store, Settings(redis_url=url, webhook_timeout_s=2.0))
    assert refused.drain() == []  # not sent
    marker = json.loads(store.r.hget(keys.notified(first), "cancelled:0") or "{}")
    assert "webhook not sent: host 127.0.0.1 is a loopback, link-local or private address" in marker["error"]
    logs = [json.loads(f["data"])["message"] for _i, f in store.r.xrange(keys.events(first)) if f["kind"] == "log"]
    assert logs == [marker["error"]] and ok.posts == []
    second = cancelled_with_webhook(store, ok.url)
    allowed = Sender(store, Settings(redis_url=url, webhook_allow="127.0.0.1", webhook_timeout_s=2.0))
    assert [f.result(30) for f in allowed.drain()] == [True] and ok.wait(1)[0]["id"] == second
    refused.stop(), allowed.stop()


def cancelled_with_webhook(store: Store, url: str) -> str:
    """A job stored with ``url`` as its webhook (no admission: as a job submitted while it was allowed), cancelled."""
    from api_schemas import ExperimentSpec
    from api_schemas.jobs import ExperimentSubmit
    from api_schemas.notify import Notify

    job, *_ = store.submit("admin", ExperimentSubmit(spec=ExperimentSpec.model_validate(tiny()),
                                                     notify=Notify(webhook=url, on=["cancelled"])))
    store.transition(job, JobState.CANCELLED, expect=[JobState.QUEUED])
    return job


def test_a_send_goes_to_the_address_just_checked_never_resolving_the_name_again(
        api_only: Api, receivers: list[Receiver], monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS rebinding: the name is resolved once, checked, and the connection goes to that address with the name in
    ``Host`` (and as the TLS SNI name). Here a DNS answer is played by ``addresses`` for ``hooks.rebind.test`` (a
    name no resolver knows: a second resolution would fail the send), and loopback is taken for a public network."""
    from service.rules import webhooks

    receivers.append(ok := Receiver())
    port = ok.server.server_address[1]
    answers = {"hooks.rebind.test": ["127.0.0.1"]}
    monkeypatch.setattr(webhooks, "addresses", lambda host, _port: answers[host])
    monkeypatch.setattr(webhooks, "internal", lambda address: False)
    settings = Settings(redis_url=api_only.stack.redis_url or "", webhook_timeout_s=2.0)
    to = webhooks.target(settings, f"https://u:p@hooks.rebind.test:{port}/x?y=1")
    assert isinstance(to, webhooks.Target) and to.url == f"https://u:p@127.0.0.1:{port}/x?y=1"
    assert to.headers == {"Host": f"hooks.rebind.test:{port}"}
    assert to.extensions == {"sni_hostname": "hooks.rebind.test"}
    answers["v6.rebind.test"] = ["2001:db8::1", "93.184.216.34"]
    assert webhooks.target(settings, "http://v6.rebind.test/x").url == "http://93.184.216.34/x"  # IPv4 first

    store = Store.from_url(api_only.stack.redis_url or "")
    job = cancelled_with_webhook(store, f"http://hooks.rebind.test:{port}/hook")
    sender = Sender(store, settings)
    assert [f.result(30) for f in sender.drain()] == [True]
    assert ok.wait(1)[0]["id"] == job and ok.posts[0][0]["Host"] == f"hooks.rebind.test:{port}"
    sender.stop()
