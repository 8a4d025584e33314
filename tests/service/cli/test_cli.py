"""The ``tlab`` console script, as a user runs it: a subprocess, exit codes, stderr messages. The commands that
start Ray (``run --ray``, ``up``, ``demo``, a job on the session's stack) are in ``test_cli_ray`` (a Ray chain of
``tests/conftest.py``); these run beside the chains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from api_schemas import keys
from tests.service.cli.tlab_process import TLAB, closed_pipe, tlab


def test_help_lists_the_commands() -> None:
    out = tlab("--help")
    assert out.returncode == 0
    for command in ("run", "compare", "presets", "validate"):
        assert f"\n    {command} " in out.stdout
    bare = tlab()
    assert bare.returncode == 2 and "COMMAND" in bare.stderr


def test_presets_and_validate_are_handed_to_the_workers_cli() -> None:
    presets = tlab("presets")
    assert presets.returncode == 0
    assert "digits/teleport" in presets.stdout and "paper/mnist-sgd" in presets.stdout
    valid = tlab("validate", "digits/teleport", "--set", "teleport.tau=0.95")
    assert valid.returncode == 0 and "tau: 0.95" in valid.stdout
    assert tlab("run", "--help").stdout.startswith("usage: tlab run")


def test_a_bad_override_exits_2_naming_the_field(tmp_path: Path) -> None:
    out = tlab("run", "digits/teleport", "--local", "--out", str(tmp_path / "run"), "--set", "teleport.tau=3",
               "training.epochs=0")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert any(line.startswith("error: teleport.tau:") for line in lines)
    assert any(line.startswith("error: training.epochs:") for line in lines)
    assert not (tmp_path / "run").exists()


def test_compare_local_runs_in_process_without_the_service_options(tmp_path: Path) -> None:
    """`tlab compare --local` hands the study to workers.cli (no service needed), leaving --url and the
    sweep-only options out; the default (a sweep on the service) is covered in tests/service/test_sweeps.py."""
    out = tlab("--url", "http://127.0.0.1:9", "compare", "--preset", "digits/teleport", "--local", "--seeds", "1",
               "--max-concurrent", "3", "--out", str(tmp_path / "c"), "--no-progress", "--set", "training.epochs=1",
               "dataset.max_train=200", "dataset.max_test=100", "model.hidden=[16]", "teleport.batches=1",
               "teleport.steps=1", "teleport.epochs=[0]")
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert set(result["groups"]) == {"nullspace teleport", "no teleport"} and result["seeds"] == 1
    assert "nullspace teleport" in out.stdout


def test_missing_dataset_files_exit_2_with_the_loader_message(tmp_path: Path) -> None:
    out = tlab("run", "paper/mnist-sgd", "--local", "--no-progress", "--out", str(tmp_path / "run"),
               "--set", f"dataset.root={tmp_path / 'nowhere'}")
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: dataset mnist") and "nowhere" in last and "dataset.root" in last
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()  # nothing started: no empty run directory left behind



def test_help_lists_the_service_commands() -> None:
    out = tlab("--help")
    for command in ("up", "submit", "ls", "show", "follow", "cancel", "plot", "queue", "cluster", "demo"):
        assert f"\n    {command} " in out.stdout, command


def test_service_commands_against_the_api(api_only, tmp_path: Path) -> None:  # noqa: ANN001
    env = {"TLAB_URL": api_only.url, "TLAB_TOKEN": api_only.stack.admin_token, "TLAB_HOME": str(tmp_path)}
    out = tlab("submit", "--preset", "digits/teleport", "--set", "training.epochs=3", "--name", "cli", env=env)
    assert out.returncode == 0, out.stderr
    job = out.stdout.split()[0]
    assert "queued" in out.stdout
    listing = tlab("ls", env=env)
    assert listing.returncode == 0 and job in listing.stdout and "cli" in listing.stdout
    shown = tlab("show", job, "--json", env=env)
    assert json.loads(shown.stdout)["spec"]["training"]["epochs"] == 3
    assert "position" in tlab("show", job, env=env).stdout
    bad = tlab("submit", "--preset", "digits/teleport", "--set", "teleport.tau=3", env=env)
    assert bad.returncode == 2 and "teleport.tau" in bad.stderr
    huge = tlab("submit", "--preset", "digits/teleport", "--set", "resources.workers=9",
                "--set", "resources.gpus_per_worker=1", env=env)
    assert huge.returncode == 1 and huge.stderr.startswith("error: spec.resources:"), huge.stderr
    dry = tlab("submit", "--preset", "digits/teleport", "--dry-run", env=env)
    assert dry.returncode == 0 and json.loads(dry.stdout)["fits_now"] is True
    hint = {"kind": "hint", "epoch": 0, "reason": "adaptive_optimizer", "message": "consider teleport.epochs: [0]"}
    with redis.Redis.from_url(api_only.stack.redis_url) as r:  # as the job's sink writes its records
        r.xadd(keys.events(job), {"kind": "status", "data": json.dumps(hint)})
    cancelled = tlab("cancel", job, env=env)
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout
    followed = tlab("follow", job, env=env)  # what `tlab submit --follow` shows: the run's hints among its states
    assert f"{job}: hint: consider teleport.epochs: [0]" in followed.stderr, followed.stderr
    again = tlab("cancel", job, env=env)
    assert again.returncode == 1 and "already ended" in again.stderr
    assert tlab("plot", job, "-o", str(tmp_path / "c.png"), env=env).returncode == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    nobody = tlab("ls", env={**env, "TLAB_TOKEN": "wrong"})
    assert nobody.returncode == 1 and "bearer token" in nobody.stderr
    down = tlab("ls", env={**env, "TLAB_URL": "http://127.0.0.1:9"})
    assert down.returncode == 1 and "tlab up" in down.stderr


def test_sweep_commands(api_only, tmp_path: Path) -> None:  # noqa: ANN001
    env = {"TLAB_URL": api_only.url, "TLAB_TOKEN": api_only.stack.admin_token, "TLAB_HOME": str(tmp_path)}
    space = tmp_path / "space.yaml"
    space.write_text("teleport.lr: {loguniform: [0.01, 1]}\ntraining.seed: {grid: [0, 1]}\n")
    out = tlab("sweep", "digits/teleport", "--space", str(space), "--scheduler", "asha", "--max-concurrent", "2",
               env=env)
    assert out.returncode == 0, out.stderr
    sweep = out.stdout.split()[0]
    assert sweep in tlab("sweeps", env=env).stdout
    shown = tlab("sweep-show", sweep, env=env)
    assert shown.returncode == 0 and "queued" in shown.stdout and "TRIAL" in shown.stdout
    space.write_text("teleport.nope: {choice: [1]}\n")
    bad = tlab("sweep", "digits/teleport", "--space", str(space), env=env)
    assert bad.returncode == 1 and "search_space.teleport.nope" in bad.stderr


def test_users_create_list_and_me(api_only, tmp_path: Path) -> None:  # noqa: ANN001
    env = {"TLAB_URL": api_only.url, "TLAB_TOKEN": api_only.stack.admin_token, "TLAB_HOME": str(tmp_path)}
    out = tlab("users", "create", "alice", "--max-gpus", "2", "--max-running-jobs", "3", env=env)
    assert out.returncode == 0, out.stderr
    assert "alice  user" in out.stdout and "max_gpus 2" in out.stdout and "shown only now" in out.stderr
    token = next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("token "))
    created = json.loads(tlab("users", "create", "bob", "--role", "admin", "--json", env=env).stdout)
    assert created["user"]["role"] == "admin" and created["token"].startswith("tl_")

    listing = tlab("users", "list", env=env)
    assert listing.returncode == 0 and listing.stdout.startswith("NAME")
    assert [line.split()[0] for line in listing.stdout.splitlines()[1:]] == ["admin", "alice", "bob"]
    # the new token works, from the environment and from --token after the command
    me = tlab("me", "--json", env={**env, "TLAB_TOKEN": token})
    assert json.loads(me.stdout)["quotas"].items() >= {"max_gpus": 2.0, "max_running_jobs": 3}.items()
    assert tlab("me", "--token", token, env=env).stdout.startswith("alice  user")
    assert tlab("--token", token, "me", env=env).stdout.startswith("alice  user")

    # a user is no admin: one line naming what is refused
    refused = tlab("users", "list", "--url", api_only.url, env={**env, "TLAB_TOKEN": token})
    assert refused.returncode == 1 and refused.stderr == "error: Authorization: only an admin may do this\n"
    taken = tlab("users", "create", "alice", env=env)
    assert taken.returncode == 1 and taken.stderr.startswith("error: name: user 'alice' exists")


def test_users_create_names_the_wrong_field(api_only, tmp_path: Path) -> None:  # noqa: ANN001
    env = {"TLAB_URL": api_only.url, "TLAB_TOKEN": api_only.stack.admin_token, "TLAB_HOME": str(tmp_path)}
    for args, field in [(("carol", "--max-gpus", "-1"), "quotas.max_gpus"),
                        (("carol", "--quota", "max_tpus=4"), "quotas.max_tpus"),
                        (("carol", "--quota", "max_running_jobs=many"), "quotas.max_running_jobs"),
                        (("Carol",), "name")]:
        out = tlab("users", "create", *args, env=env)
        assert out.returncode == 1, args
        assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"error: {field}: "), out.stderr
    assert "carol" not in tlab("users", "list", env=env).stdout


def test_every_read_command_prints_json(api_only, tmp_path: Path) -> None:  # noqa: ANN001
    env = {"TLAB_URL": api_only.url, "TLAB_TOKEN": api_only.stack.admin_token, "TLAB_HOME": str(tmp_path)}
    job = tlab("submit", "--preset", "digits/teleport", "--name", "json", env=env).stdout.split()[0]
    space = tmp_path / "space.yaml"
    space.write_text("teleport.lr: {choice: [0.1, 0.2]}\n")
    sweep = tlab("sweep", "digits/teleport", "--space", str(space), env=env).stdout.split()[0]
    reads = {("ls",): list, ("show", job): dict, ("sweeps",): list, ("sweep-show", sweep): dict,
             ("queue",): list, ("cluster",): dict, ("users", "list"): list, ("me",): dict, ("presets",): dict}
    for args, kind in reads.items():
        out = tlab(*args, "--json", env=env)
        assert out.returncode == 0, (args, out.stderr)
        assert isinstance(json.loads(out.stdout), kind), args
    # the human forms: tables, not JSON
    queue = tlab("queue", env=env).stdout.splitlines()
    assert queue[0].split()[:3] == ["POS", "ID", "OWNER"]  # no scheduler here: both wait at the end
    assert {row.split()[1] for row in queue[1:]} == {job, sweep} and "1 x (1 CPU, 0 GPU)" in queue[1]
    cluster = tlab("cluster", env=env).stdout
    assert "no scheduler has reported" in cluster and "CPUs 0 free of 0" in cluster
    assert "sandbox on" in cluster.splitlines()  # where a job's code runs (bwrap on this machine)


def test_completion_scripts_name_the_commands() -> None:
    bash = tlab("completion", "bash")
    assert bash.returncode == 0
    for command in ("submit", "queue", "cluster", "users", "create", "bootstrap", "completion", "presets"):
        assert command in bash.stdout, command
    assert subprocess.run(["bash", "-n"], input=bash.stdout, text=True, timeout=30).returncode == 0
    for shell in ("zsh", "tcsh"):
        out = tlab("completion", shell)
        assert out.returncode == 0 and "sweep-show" in out.stdout, shell
    assert tlab("completion", "fish").returncode == 2


FIRST, SECOND = "tl_first_" + "1" * 32, "tl_second_" + "2" * 32


def test_admin_bootstrap_makes_a_token_that_signs_in(api_only, tmp_path: Path) -> None:  # noqa: ANN001
    env = {"TLAB_URL": api_only.url, "TLAB_HOME": str(tmp_path), "REDIS_URL": api_only.stack.redis_url or ""}
    first = tlab("admin", "bootstrap", "--name", "root", env={**env, "TLAB_ADMIN_TOKEN": FIRST})
    assert first.returncode == 0 and "created" in first.stdout, first.stderr
    again = tlab("admin", "bootstrap", "--name", "root", env={**env, "TLAB_ADMIN_TOKEN": SECOND})
    assert again.returncode == 0 and "re-pointed" in again.stdout, again.stderr
    me = tlab("me", "--json", env={**env, "TLAB_TOKEN": SECOND})
    assert me.returncode == 0, me.stderr
    assert json.loads(me.stdout)["name"] == "root" and json.loads(me.stdout)["role"] == "admin"
    assert tlab("users", "list", env={**env, "TLAB_TOKEN": SECOND}).returncode == 0

    no_token = tlab("admin", "bootstrap", env={**env, "TLAB_ADMIN_TOKEN": ""})
    assert no_token.returncode == 1 and no_token.stderr.startswith("error: TLAB_ADMIN_TOKEN is empty")
    tlab("users", "create", "plain", env={**env, "TLAB_TOKEN": SECOND})
    not_admin = tlab("admin", "bootstrap", "--name", "plain", env={**env, "TLAB_ADMIN_TOKEN": "tl_x" * 10})
    assert not_admin.returncode == 1 and "role user, not admin" in not_admin.stderr
    down = tlab("admin", "bootstrap", "--redis-url", "redis://127.0.0.1:9/0", env={**env, "TLAB_ADMIN_TOKEN": FIRST})
    assert down.returncode == 1 and down.stderr.startswith("error: REDIS_URL: cannot use Redis")
    assert "Traceback" not in down.stderr


def test_help_imports_neither_the_http_client_nor_the_spec_loader() -> None:
    """`tlab --help` stays fast: the parser is built from argparse alone; each command imports what it needs."""
    code = ("import sys; from service.cli import build_parser; build_parser().format_help(); "
            "print(' '.join({m.split('.')[0] for m in sys.modules}))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                timeout=60).stdout.split())
    assert "service" in loaded
    assert not {"httpx", "pydantic", "pydantic_settings", "yaml", "shtab", "tqdm", "redis"} & loaded


def test_table_cells_are_cut_with_an_ellipsis(capsys: pytest.CaptureFixture[str]) -> None:
    from service.cli.common import CELL_MAX, cut, print_table

    assert cut("x" * CELL_MAX) == "x" * CELL_MAX
    assert cut("x" * (CELL_MAX + 1)) == "x" * (CELL_MAX - 1) + "…" and len(cut("y" * 500)) == CELL_MAX
    print_table([("ID", "NOTE", "WHY"), ("j1", "n" * 200, "w" * 200), ("j2", "short", "ok")])
    head, long, short = capsys.readouterr().out.splitlines()
    assert long == "j1  " + "n" * (CELL_MAX - 1) + "…  " + "w" * (CELL_MAX - 1) + "…"
    assert head.index("WHY") == short.index("ok") == long.index("w")  # columns still line up


def test_a_closed_pipe_ends_quietly() -> None:
    """Local and handed-over commands alike: exit 141 (as a shell reports SIGPIPE), no traceback."""
    for args in (("completion", "bash"), ("presets", "--json"), ("presets",), ("validate", "digits/teleport")):
        out = closed_pipe(*args)
        assert (out.returncode, out.stderr) == (141, ""), (args, out.stderr[-2000:])
    assert closed_pipe("--help").stderr == ""


def test_long_cells_are_cut_and_service_commands_end_quietly_on_a_closed_pipe(
        api_only, tmp_path: Path) -> None:  # noqa: ANN001
    from api_schemas.jobs import JobState
    from service.core.store import Store

    env = {"TLAB_URL": api_only.url, "TLAB_TOKEN": api_only.stack.admin_token, "TLAB_HOME": str(tmp_path)}
    name = "an-experiment-whose-name-goes-on-and-on"
    job = tlab("submit", "--preset", "digits/teleport", "--name", name, env=env).stdout.split()[0]
    reason = "preflight: build_model() raised ValueError: " + "mat1 and mat2 shapes cannot be multiplied " * 4
    store = Store.from_url(api_only.stack.redis_url or "")
    assert store.transition(job, JobState.FAILED, expect=[JobState.QUEUED], reason="preflight failed",
                            failure_reason=reason)
    listing = tlab("ls", env=env)
    row = next(line for line in listing.stdout.splitlines() if line.startswith(job))
    assert f" {name[:23]}… " in row and row.endswith(f"  {reason[:59]}…"), row
    assert reason in tlab("show", job, env=env).stdout  # the whole text where there is room
    assert json.loads(tlab("ls", "--json", env=env).stdout)[0]["failure_reason"] == reason
    for args in (("ls",), ("ls", "--json"), ("show", job), ("users", "list")):
        out = closed_pipe(*args, env=env)
        assert (out.returncode, out.stderr) == (141, ""), (args, out.stderr[-2000:])


def test_a_gang_is_shown_with_its_memory_when_it_asks_some() -> None:
    from service.cli.common import gang

    demand = {"workers": 2, "cpus_per_worker": 1, "gpus_per_worker": 0.5}
    assert gang(demand) == gang({**demand, "memory_gb": None}) == "2 x (1 CPU, 0.5 GPU)"
    assert gang({**demand, "memory_gb": 4}) == "2 x (1 CPU, 0.5 GPU, 4 GiB)"


def test_compare_uploads_the_code_for_every_trial(api_only, tmp_path: Path) -> None:  # noqa: ANN001
    """``tlab compare SPEC --code DIR`` on the service: DIR uploaded once, the sweep's base names it (here the sweep
    stays queued, no scheduler: it is cancelled, and compare ends saying so)."""
    import time

    import httpx

    env = {"TLAB_URL": api_only.url, "TLAB_TOKEN": api_only.stack.admin_token, "TLAB_HOME": str(tmp_path)}
    (tmp_path / "code" / "cmpsvc").mkdir(parents=True)
    (tmp_path / "code" / "cmpsvc" / "__init__.py").write_text("")
    (tmp_path / "code" / "cmpsvc" / "models.py").write_text("def build():\n    raise SystemExit\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {kind: custom, factory: cmpsvc.models:build}\ndataset: {name: digits}\n"
                    "training: {epochs: 2}\n")
    proc = subprocess.Popen([TLAB, "compare", str(spec), "--code", str(tmp_path / "code"), "--seeds", "1",
                             "--no-progress", "--out", str(tmp_path / "out")], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=api_only.url, headers={"Authorization": f"Bearer {env['TLAB_TOKEN']}"}) as c:
            deadline = time.monotonic() + 60
            while not (sweeps := c.get("/v1/sweeps").json()["items"]):
                assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
                time.sleep(0.2)
            package = sweeps[0]["spec"]["code"]["package"]  # (a sweep's view shows its base spec)
            assert package.startswith("sha256:") and c.get(f"/v1/code/{package}").status_code == 200
            c.post(f"/v1/sweeps/{sweeps[0]['id']}/cancel").raise_for_status()
        _out, err = proc.communicate(timeout=60)
        assert "code " in err and "uploaded" in err, err
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("tty", [True, False])
def test_a_sweeps_follow_is_one_bar_over_every_trials_epochs(api_only, capsys: pytest.CaptureFixture[str],  # noqa: ANN001
                                                             monkeypatch: pytest.MonkeyPatch, tty: bool) -> None:
    """Two trials of 2 epochs: one bar to 4/4, not one that starts again with each trial; into a pipe, a plain line
    per epoch that says where the whole sweep is, no carriage returns."""
    from service.cli.client import Client
    from service.cli.jobs import follow_one

    with Client(api_only.url, api_only.stack.admin_token) as c:
        base = {"dataset": {"name": "digits"}, "model": {"kind": "mlp", "hidden": [8]}, "training": {"epochs": 2}}
        sweep = c.json("POST", "/v1/sweeps", json={"base": base, "search_space": {"training.seed": {"grid": [0, 1]}}})
        with redis.Redis.from_url(api_only.stack.redis_url) as r:  # as the trials' sinks write their epochs
            for trial in ("t_a", "t_b"):
                for epoch in (0, 1):
                    r.xadd(keys.events(sweep["id"]), {"kind": "metric", "data": json.dumps(
                        {"kind": "epoch", "trial": trial, "epoch": epoch, "train_loss": 1.0, "test_loss": 1.0})})
        c.json("POST", f"/v1/sweeps/{sweep['id']}/cancel")
        monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
        assert follow_one(c, sweep["id"], trials=2) == 1  # (cancelled)
    err = capsys.readouterr().err
    bars = [line for line in err.replace("\r", "\n").splitlines() if "epoch" in line]
    if tty:
        assert bars and "4/4" in bars[-1] and not any(" 2/2 " in b for b in bars), bars
    else:
        assert "\r" not in err and [b.split(" (")[1].split()[0] for b in bars] == ["1/4", "2/4", "3/4", "4/4"], bars
        assert [b.split(" trial ")[1].split(" (")[0] for b in bars] == [
            "t_a epoch 1/2", "t_a epoch 2/2", "t_b epoch 1/2", "t_b epoch 2/2"], bars
