"""A job's code plays the attacker on the real stack: a user with code rights submits a package whose model
factory looks around before it builds the model, in a 1-worker job and on both ranks of a 2-rank gang, and logs what
it found. Every attempt must be refused: other processes' environments, the service's and the Ray head's secret files,
another job's files, a Ray token or the service's Redis URL in its environment, writing outside its job directory,
signalling a process of ours (a write outside its directory may land in its private /tmp, where a test's TLAB_HOME
lies, but never on the host); and the jobs still train (metrics, checkpoints, artifacts across the sandbox's line)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from service.cli.client import Client
from service.cli.code_zip import upload
from service.core.settings import Settings
from service.stack.embedded import Stack
from tests.service.conftest import Api, tiny
from tests.service.test_code_packages import wait_end
from workers.job import job_user

pytestmark = pytest.mark.slow

ATTACKER = '''
import json, os, signal
from pathlib import Path

from torch import nn

SECRETS = ("admin.token", "redis.password", "ray.token", "redis.conf")


def readable(path):
    try:
        with open(path, "rb") as f:
            return bool(f.read(1) or True)
    except OSError:
        return False


def writable(path):
    try:
        with open(path, "w") as f:
            f.write("pwned")
        return True
    except OSError:
        return False


def signalled(pid):
    try:
        os.kill(pid, signal.SIGCONT)  # harmless to a running process, and proof that a SIGKILL would land too
        return True
    except OSError:
        return False


def whoami(url):
    import redis

    try:
        return redis.Redis.from_url(url, decode_responses=True).execute_command("ACL", "WHOAMI")
    except Exception as err:
        return f"{type(err).__name__}"


def look(homes, storage, victim, pids):
    me, tree = os.getpid(), [Path(p) for p in os.listdir("/proc") if p.isdigit()]
    found = {"uid": os.getuid(), "pids_seen": len(tree)}
    found["environ"] = [p.name for p in tree if int(p.name) != me and readable(f"/proc/{p.name}/environ")
                        and Path(f"/proc/{p.name}/environ").read_bytes()]
    found["secrets"] = [f"{h}/{n}" for h in homes for n in SECRETS if readable(Path(h) / n)]
    victim_dir = Path(storage) / victim
    found["other_jobs"] = [str(p) for p in victim_dir.rglob("*") if p.is_file() and readable(p)] + (
        [str(victim_dir)] if victim_dir.exists() else [])
    found["storage_listed"] = sorted(os.listdir(storage)) if os.path.isdir(storage) else []
    found["env"] = sorted(k for k in os.environ if k.startswith(("RAY_", "TLAB_JOB_TICKET", "TLAB_HOME"))
                          or any(w in k for w in ("PASSWORD", "SECRET", "TOKEN", "CREDENTIAL", "AWS_")))
    found["redis_users"] = [whoami(v) for k, v in os.environ.items() if v.startswith(("redis://", "unix://"))]
    import workers
    targets = [*(Path(h) / "pwned" for h in homes), Path(storage) / "pwned", victim_dir / "pwned",
               Path(workers.__file__).parent / "pwned", Path.cwd() / "pwned"]
    found["writes"] = [str(t) for t in targets if writable(t)]
    found["signals"] = [pid for pid in pids if signalled(pid)]
    return found


def build(homes, storage, victim, pids):
    print("ATTACK " + json.dumps(look(homes, storage, victim, pids)), flush=True)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
'''


def plant_victim(storage: Path) -> str:
    """Another user's finished job, as far as its files go (the secret its weights are)."""
    victim = storage / "victim-job"
    (victim / "artifacts").mkdir(parents=True)
    (victim / "artifacts" / "model.safetensors").write_text("unpublished weights")
    (victim / "checkpoint_2026-01-01_00-00-00.000000").mkdir()
    (victim / "checkpoint_2026-01-01_00-00-00.000000" / "checkpoint.pt").write_text("unpublished weights")
    os.chmod(victim, 0o700)  # as the stack keeps it (tlab up's umask 077)
    return victim.name


def attack(c: Client, package: str, args: dict, **resources: object) -> tuple[str, list[dict]]:
    """Submit the attacker as a job: its id and what each rank found (from each rank's log)."""
    spec = {**tiny(training={"epochs": 2}), "code": {"package": package},
            "model": {"kind": "custom", "factory": "attacker.model:build", "args": args}}
    if resources:
        spec["resources"] = resources
    job = c.submit(spec, name="attacker")["id"]
    view = wait_end(c, job)
    assert view["state"] == "succeeded", view.get("failure_reason")  # it still trains, checkpoints, exports
    assert [p["epoch"] for p in c.json("GET", f"/v1/experiments/{job}/metrics")["points"]] == [0, 1]
    ranks = int(resources.get("workers", 1))  # type: ignore[call-overload]
    logs = [c.logs(job, rank=str(r)) for r in range(ranks)]
    attacks = [[x for x in log.splitlines() if "ATTACK " in x] for log in logs]
    assert [len(a) for a in attacks] == [1] * ranks, attacks  # each rank's log holds its own lines, no other rank's
    found = [json.loads(a[0].removeprefix("ATTACK ")) for a in attacks]
    return job, found


def test_a_jobs_code_finds_nothing_of_other_jobs_or_the_control_plane(stack: Stack, ray_head: Stack,
                                                                     tmp_path: Path) -> None:
    api = Api(stack)
    api.add_user("mallory")
    with api.client() as admin:
        assert admin.patch("/v1/users/mallory", json={"can_submit_code": True}).status_code == 200
    storage = Path(Settings(TLAB_HOME=stack.home).storage_path)
    victim = plant_victim(storage)
    pkg = tmp_path / "pkg" / "attacker"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(textwrap.dedent(ATTACKER))
    ours = [stack.procs[name].pid for name in ("api", "scheduler")] + [os.getpid()]
    homes = [str(stack.home), str(ray_head.home)]
    secrets = [stack.admin_token, ray_head.ray_token, *[(Path(h) / "admin.token").read_text().strip()
                                                        for h in homes if (Path(h) / "admin.token").exists()]]
    with Client(stack.url, api.tokens["mallory"]) as c:
        assert c.json("GET", "/v1/cluster")["sandbox"] == "on"
        package = upload(c, str(pkg.parent))["package"]
        for resources in ({}, {"workers": 2, "cpus_per_worker": 0.9}):
            args = {"homes": homes, "storage": str(storage), "victim": victim, "pids": ours}
            job, found = attack(c, package, args, **resources)
            for rank, seen in enumerate(found):
                # the job's own uid on the host (never root's), in its own PID namespace
                assert seen["uid"] == job_user.job_uid(job) and seen["pids_seen"] <= 4, (rank, seen)
                refused = {k: seen[k] for k in ("environ", "secrets", "other_jobs", "env", "signals")}
                assert refused == {k: [] for k in refused}, (job, rank, seen)
                # a write outside its directory fails, or lands in its private /tmp (where a test's home is): never here
                assert [t for t in seen["writes"] if Path(t).exists()] == [], seen
                assert seen["storage_listed"] in ([], [job]), seen  # its own directory, nothing beside it
                assert seen["redis_users"] in ([], [f"tlab-job-{job}"]), seen  # its own ACL user, if any
            logs = "".join(c.logs(job, rank=str(r)) for r in range(len(found)))
            assert not [s for s in secrets if s and s in logs]
            assert (storage / job / "artifacts" / "model.safetensors").is_file()  # exported inside the sandbox
    planted = [p for p in [*storage.rglob("pwned"), *stack.home.rglob("pwned"), *ray_head.home.rglob("pwned"),
                           Path(__file__).parents[2] / "workers" / "pwned"] if p.exists()]
    assert planted == []


@pytest.fixture()
def api_env() -> dict[str, str]:
    """The API alone, on a PATH without bubblewrap: no sandbox can run (``service.core.sandbox_state``)."""
    return {"PATH": str(Path(sys.executable).parent)}


def test_without_a_sandbox_users_code_is_refused_at_submit_and_the_cluster_says_why(api_only: Api) -> None:
    spec = {**tiny(), "model": {"kind": "custom", "factory": "attacker.model:build"},
            "code": {"package": "sha256:" + "0" * 64}}
    with api_only.client() as c:
        sandbox = c.get("/v1/cluster").json()["sandbox"]
        assert sandbox.startswith("unavailable: bubblewrap is not installed"), sandbox
        r = c.post("/v1/experiments", json={"spec": spec})
        assert r.status_code == 403 and "no sandbox can hold users' code" in r.text, r.text
        assert "TLAB_SANDBOX=off" in r.text
        assert c.post("/v1/experiments", json={"spec": tiny()}).status_code == 201  # built-in jobs need none
