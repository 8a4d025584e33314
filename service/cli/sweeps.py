"""Hyperparameter sweeps on the service: ``sweep``, ``sweeps``, ``sweep-show``, ``sweep-rerun``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.cli.after_notify import add_after_notify, after_notify
from service.cli.common import (
    add_code_arg,
    add_read_command,
    add_remote_args,
    add_spec_args,
    client,
    cut,
    fail,
    fmt,
    get_json,
    print_json,
    print_table,
    spec_from,
)
from service.cli.jobs import follow_one

if TYPE_CHECKING:
    from service.cli.client import Client

LIVE = ("succeeded", "queued", "starting", "running")  # sweep states `sweep-show` exits 0 on


def _space(path: str) -> dict[str, Any]:
    import yaml

    space_path = Path(path)
    if not space_path.exists():
        fail(f"--space {space_path}: no such file (YAML: `teleport.lr: {{loguniform: [0.01, 1]}}`)")
    return yaml.safe_load(space_path.read_text()) or {}


def cmd_sweep(args: argparse.Namespace) -> int:
    body = {"base": spec_from(args), "search_space": _space(args.space), "num_samples": args.num_samples,
            "metric": args.metric, "mode": args.mode, "scheduler": args.scheduler,
            "max_concurrent_trials": args.max_concurrent, "searcher": args.searcher, "seed": args.seed,
            "grace_period": args.grace_period, "perturbation_interval": args.perturbation_interval,
            "name": args.name or "", "priority": args.priority, "tags": args.tag, **after_notify(args)}
    from api_schemas.sweeps import SweepSubmit
    from service.cli.code_zip import with_code

    with client(args) as c:
        body["base"] = with_code(c, body["base"], args.code)
        job = c.json("POST", "/v1/sweeps", json=body)
        print(f"{job['id']}  {job['state']}  position {fmt(job.get('queue_position'))}", flush=True)
        if not args.follow:
            return 0
        follow_one(c, job["id"], trials=SweepSubmit.model_validate(body).trial_count())  # one bar for them all
        return show_sweep(c, job["id"])


def cmd_sweep_rerun(args: argparse.Namespace) -> int:
    with client(args) as c:
        job = c.json("POST", f"/v1/sweeps/{args.id}/rerun", json={"trials": "failed" if args.failed else args.trial})
        print(f"{job['id']}  {job['state']}  position {fmt(job.get('queue_position'))}  "
              f"({job.get('pending_reason') or 'queued'})", flush=True)
        if not args.follow:
            return 0
        trials = len(args.trial) if args.trial else sum(
            t["state"] == "failed" for t in c.json("GET", f"/v1/sweeps/{args.id}")["trials"])
        follow_one(c, job["id"], trials=max(1, trials))
        return show_sweep(c, job["id"])


def _trial_row(t: dict[str, Any], best: dict[str, Any]) -> tuple[str, ...]:
    mark = "*" if t["trial"] == best.get("trial") else " "
    state = t["state"] + (f" (PBT moves: {t['perturbed']})" if t.get("perturbed") else "") + (
        f" (reruns: {t['reruns']})" if t.get("reruns") else "")
    config = " ".join(f"{k}={fmt(v)}" for k, v in t["config"].items())
    return f"{mark}{t['trial']}", state, str(t["epochs"]), fmt(t.get("last")), fmt(t.get("best")), config


def show_sweep(c: Client, sweep_id: str, as_json: bool = False) -> int:
    """The sweep's state line, its trials table (``*`` marks the best) and the best trial."""
    view = c.json("GET", f"/v1/sweeps/{sweep_id}")
    if as_json:
        return print_json(view)
    job = view["job"]
    print(f"{job['id']}  {job['name']}  ({job['owner']})  {job['state']}"
          + (f"  ({job['failure_reason']})" if job.get("failure_reason") else ""))
    metric, best = view["metric"], view.get("best") or {}
    rows = [("TRIAL", "STATE", "EPOCHS", f"LAST {metric}", f"BEST {metric}", "CONFIG")]
    print_table(rows + [_trial_row(t, best) for t in view["trials"]])
    if best:
        print(f"best: {best['trial']} ({metric} {fmt(best.get('best'))})")
    return 0 if job["state"] in LIVE else 1


def cmd_sweep_show(args: argparse.Namespace) -> int:
    with client(args) as c:
        return show_sweep(c, args.id, args.json)


def cmd_sweeps(args: argparse.Namespace) -> int:
    items = get_json(args, "/v1/sweeps", limit=args.limit)["items"]
    if args.json:
        return print_json(items)
    for j in items:
        print(f"{j['id']}  {j['state']:<10} {cut(j['name'], 30):<30} {j['owner']}")
    return 0


def add_commands(sub: Any) -> None:
    p = sub.add_parser("sweep", help="queue a hyperparameter sweep: `tlab sweep SPEC --space SPACE.yaml [--follow]`")
    add_spec_args(p, "the base spec: a YAML/JSON file or a preset name")
    p.add_argument("--space", required=True, help="YAML: dotted spec path -> {loguniform|uniform|randint: [lo, hi]} "
                                                  "or {choice|grid: [values]}")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--metric", default="train_loss", choices=["train_loss", "test_loss", "test_acc"])
    p.add_argument("--mode", default="min", choices=["min", "max"])
    p.add_argument("--scheduler", default="fifo", choices=["fifo", "asha", "pbt"])
    p.add_argument("--searcher", default="random", choices=["random", "grid", "optuna"])
    p.add_argument("--seed", type=int, default=None, help="seeds the random or Optuna sampler")
    p.add_argument("--grace-period", type=int, default=1, help="ASHA: epochs before a trial can be stopped")
    p.add_argument("--perturbation-interval", type=int, default=2, help="PBT: epochs between exploit/explore rounds")
    p.add_argument("--max-concurrent", type=int, default=1, help="trials at once (the sweep's gang)")
    p.add_argument("--name", default=None)
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--tag", action="append", default=[])
    add_after_notify(p, "sweep")
    p.add_argument("--follow", action="store_true", help="follow until it ends, then print the trials table")
    add_code_arg(p)
    p.set_defaults(func=cmd_sweep)
    add_remote_args(p)

    p = sub.add_parser("sweep-rerun", help="run failed or cancelled trials of an ended sweep again, in the same "
                                           "sweep: `tlab sweep-rerun ID --failed | --trial TRIAL ... [--follow]`",
                       description="Each trial goes on from its last checkpoint (from scratch if it kept none); the "
                                   "sweep keeps its id, trials table and best trial, and is queued as a submit is. "
                                   "Trials a cancel cut off always go on with it (docs/rest.md, Rerunning trials).")
    p.add_argument("id", help="the sweep")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--failed", action="store_true",
                       help="every trial that failed or was cut off (cancelled) when the sweep ended")
    which.add_argument("--trial", action="append", metavar="TRIAL", help="this trial (repeat for several)")
    p.add_argument("--follow", action="store_true", help="follow until it ends, then print the trials table")
    p.set_defaults(func=cmd_sweep_rerun)
    add_remote_args(p)

    add_read_command(sub, "sweeps", "your sweeps, newest first", cmd_sweeps,
                     options={"--limit": {"type": int, "default": 50}})
    add_read_command(sub, "sweep-show", "a sweep's trials table and its best trial", cmd_sweep_show, "id")
