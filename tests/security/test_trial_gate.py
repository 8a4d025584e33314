"""Red team: a sweep trial's reports and its trials row, as the trusted side takes them.

A trial's payload reports each checkpoint as a path on a pipe, and may write its sweep's trials table (its Redis user
may). Probes: a report naming a host directory (the trial process, the supervisor, used to delete it); a report naming
a directory of links to the service's secrets and another user's weights (Tune copied through the links, and a
retry's sandbox received the copies); a forged trials row whose trial is ``/../../<victim>`` with the best score (the
sweep's driver exported the victim's weights as the sweep's). The relay (``workers.on_ray.trial_bridge.Relay``) and the
export (``workers.sweep.export_best``) are run as the trial process and the sweep's driver run them: a real Ray Tune
run on the session's Ray head, real files, a real Redis."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from api_schemas import gate
from workers.on_ray.trial_bridge import Relay

SWEEP, VICTIM = "18f3a2b4c5d-a00000", "18f3a2b4c5d-b00000"
TRIAL = "ab12c_00000"
SECRETS = ("admin.token", "redis.password", "ray.token")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def line(checkpoint: object) -> bytes:
    return json.dumps({"metrics": {"final_train_loss": 0.5, "epochs": 1}, "checkpoint": checkpoint}).encode()


def test_a_report_naming_a_host_directory_deletes_nothing(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "keep").write_text("alive")
    storage = tmp_path / "storage"
    scratch = storage / SWEEP / "trials" / TRIAL
    scratch.mkdir(parents=True)
    (scratch / "report-planted").symlink_to(canary)  # a report directory that is a link out
    relay = Relay(str(storage), SWEEP, TRIAL)
    for named in (str(canary), f"{scratch}/../../../../canary", "../../../../canary", str(scratch), str(storage),
                  str(scratch / "report-planted"), "report-planted", str(scratch / "report-x" / "inner"), 7):
        with pytest.raises(gate.Refused):
            relay(line(named))
    assert (canary / "keep").read_text() == "alive" and (scratch / "report-planted").is_symlink()


PROBE = '''
import hashlib, json, os, sys, tempfile
from pathlib import Path

import ray, redis, torch
from ray import tune

from api_schemas import keys
from api_schemas.sweeps import SweepSubmit
from workers.on_ray.trial_bridge import Relay
from workers.sweep import export_best
from workers.train.context import write_checkpoint

storage, sweep_id, victim, home, redis_url, address = sys.argv[1:7]


def trial(config):
    """A trial process's reports, as its sandboxed payload makes them: one honest checkpoint, then a directory of
    links to the service's secrets and to the victim's weights; and a forged row in the sweep's trials table."""
    trial_id = tune.get_context().get_trial_id()
    relay = Relay(storage, sweep_id, trial_id)
    scratch = Path(storage, sweep_id, "trials", trial_id)
    scratch.mkdir(parents=True, exist_ok=True)
    loss = 0.5 + config["training.seed"]
    own = Path(tempfile.mkdtemp(prefix="report-", dir=scratch))
    history = [{"kind": "epoch", "epoch": 0, "train_loss": loss, "test_loss": loss, "seconds": 1.0}]
    write_checkpoint({"model": {"w": torch.full((4,), loss)}, "history": history, "epoch": 1}, own)
    digest = hashlib.sha256((own / "checkpoint.pt").read_bytes()).hexdigest()
    Path(storage, f"{trial_id}.sha256").write_text(digest)
    relay(json.dumps({"metrics": {"final_train_loss": loss, "epochs": 1}, "checkpoint": str(own)}).encode())
    links = Path(tempfile.mkdtemp(prefix="report-", dir=scratch))
    for name in ("admin.token", "redis.password", "ray.token"):
        (links / name).symlink_to(Path(home, name))
    (links / "checkpoint.pt").symlink_to(Path(storage, victim, "checkpoint_000001", "checkpoint.pt"))
    (links / "home").symlink_to(home)
    relay(json.dumps({"metrics": {"final_train_loss": loss + 1, "epochs": 2}, "checkpoint": str(links)}).encode())
    row = {"trial": f"/../../{victim}", "config": config, "state": "succeeded", "epochs": 2, "last": -1e9,
           "best": -1e9, "stopped_early": False}
    redis.Redis.from_url(redis_url).hset(keys.trials(sweep_id), trial_id, json.dumps(row))


ray.init(address=address, log_to_driver=False)
base = {"dataset": {"name": "digits"}, "model": {"kind": "mlp", "hidden": [8]}, "training": {"epochs": 2}}
sweep = SweepSubmit.model_validate({"base": base, "search_space": {"training.seed": {"grid": [0, 1]}}})
tuner = tune.Tuner(tune.with_resources(trial, {"cpu": 0, "memory": 1 << 20}),
                   param_space={"training.seed": tune.grid_search([0, 1])},
                   run_config=tune.RunConfig(name=f"sweep-{sweep_id}", storage_path=storage,
                                             failure_config=tune.FailureConfig(max_failures=0)))
results = tuner.fit()
assert not any(r.error for r in results), [str(r.error) for r in results]
print(json.dumps(export_best(sweep_id, sweep, storage)))
'''


def test_reports_of_links_and_a_forged_trials_row_reach_nothing_of_anothers(
    ray_head: Any, redis_server: str, tmp_path: Path
) -> None:
    import torch

    from workers.train.context import write_checkpoint

    home, storage = tmp_path / "home", tmp_path / "storage"
    home.mkdir()
    for name in SECRETS:
        (home / name).write_text(f"secret-{name}-{os.urandom(8).hex()}")
    victim = storage / VICTIM / "checkpoint_000001"
    victim.mkdir(parents=True)
    write_checkpoint({"model": {"w": torch.full((4,), 42.0)}, "history": [], "epoch": 1}, victim)
    (tmp_path / "probe.py").write_text(PROBE)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": ray_head.ray_token,
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # the driver on loopback, where the head is
    address = f"127.0.0.1:{ray_head.ray_ports['--port']}"
    done = subprocess.run([sys.executable, str(tmp_path / "probe.py"), str(storage), SWEEP, VICTIM, str(home),
                           redis_server, address], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    best = json.loads(done.stdout.strip().splitlines()[-1])

    # the sweep's artifacts are its best trial's own checkpoint (Tune's word), not the victim's
    exported = storage / SWEEP / "artifacts" / "checkpoint.pt"
    assert best["best"] == 0.5 and sha(exported) == (storage / f"{best['trial']}.sha256").read_text()
    assert sha(exported) != sha(victim / "checkpoint.pt")
    assert json.loads((storage / SWEEP / "artifacts" / "summary.json").read_text())["trial"] == best["trial"]

    # what Tune kept of every report: no link, no secret, no other run's weights; the payload's copies are gone
    kept = [p for p in (storage / f"sweep-{SWEEP}").rglob("*") if "checkpoint_" in str(p)]
    assert kept and not [p for p in kept if p.is_symlink()], kept
    secrets = [(home / name).read_bytes() for name in SECRETS]
    victims = (victim / "checkpoint.pt").read_bytes()
    for path in (p for p in kept if p.is_file()):
        data = path.read_bytes()
        assert not any(s in data for s in secrets) and data != victims, path
    assert not [p for p in (storage / SWEEP / "trials").rglob("report-*")]
