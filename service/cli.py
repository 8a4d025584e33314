"""``tlab``: the command line.

Service commands (``up``, ``submit``, ``ls``, ``show``, ``follow``, ``cancel``, ``plot``, ``sweep``,
``sweeps``, ``sweep-show``, ``compare``, ``queue``, ``cluster``, ``demo``) talk to the REST API (``--url``/
``TLAB_URL``, ``--token``/``TLAB_TOKEN``; by default the local ``tlab up``). Commands that train or
read specs in this process (``run``, ``compare --local``, ``presets``, ``validate``) live in ``workers.cli``
and are handed over with ``exec`` so this module never imports torch, teleport or workers
(DESIGN.md's wall around ``service/``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from service.client import ApiError, Client, home

# command -> one-line help; each runs as `python -m workers.cli COMMAND ...` (its own --help has the details)
WORKER_COMMANDS = {
    "run": "train one spec in this process: `tlab run SPEC --local [--out DIR] [--set path=value ...]`",
    "presets": "list the presets (paper table rows and fast digits demos)",
    "validate": "print the normalized spec, or one line per wrong field",
}
TERMINAL = {"succeeded", "failed", "cancelled"}


def _client(args: argparse.Namespace) -> Client:
    return Client(args.url, args.token)


def _fmt(value: Any, digits: int = 4) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return "-" if value is None else str(value)


def _progress(job: dict[str, Any]) -> str:
    p = job.get("progress") or {}
    if p.get("epoch") is None:
        return "-"
    text = f"{p['epoch']}/{p.get('epochs') or '?'}"
    return text + (f" loss {_fmt(p['train_loss'])}" if p.get("train_loss") is not None else "")


def _spec_from(args: argparse.Namespace) -> dict[str, Any]:
    from api_schemas.spec_io import build_spec, load_spec_data

    source = args.preset or args.spec
    if not source:
        raise SystemExit("error: give a SPEC file or --preset NAME (`tlab presets` lists them)")
    return build_spec(load_spec_data(source), args.overrides).model_dump(mode="json")


# ---- commands -------------------------------------------------------------------------------------


def cmd_up(args: argparse.Namespace) -> int:
    from service.stack import up

    return up(Path(args.home).expanduser() if args.home else home(), args.port, args.num_cpus)


def cmd_submit(args: argparse.Namespace) -> int:
    spec = _spec_from(args)
    with _client(args) as c:
        if args.dry_run:
            r = c.json("POST", "/v1/experiments", params={"dry_run": "true"}, json={"spec": spec})
            print(json.dumps(r, indent=2))
            return 0 if r["fits_ever"] else 1
        job = c.submit(spec, name=args.name or "", priority=args.priority, tags=args.tag)
        print(f"{job['id']}  {job['state']}  position {_fmt(job.get('queue_position'))}", flush=True)
        return follow_one(c, job["id"]) if args.follow else 0


def cmd_ls(args: argparse.Namespace) -> int:
    with _client(args) as c:
        jobs = c.list(state=args.state, owner=args.owner, tag=args.tag, limit=args.limit)
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    rows = [("ID", "NAME", "OWNER", "STATE", "PROGRESS", "WHY / RESULT")]
    for j in jobs:
        note = j.get("pending_reason") or j.get("failure_reason") or ""
        if j["state"] == "succeeded" and j.get("summary"):
            note = f"test loss {_fmt(j['summary'].get('final_test_loss'))}"
        rows.append((j["id"], j["name"][:24], j["owner"], j["state"], _progress(j), note[:60]))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r[:5], widths, strict=True)) + "  " + r[5])
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.get(args.id)
    if args.json:
        print(json.dumps(job, indent=2))
        return 0
    print(f"{job['id']}  {job['name']}  ({job['owner']})\n  state     {job['state']}")
    if job["state"] == "queued":
        print(f"  position  {_fmt(job.get('queue_position'))}\n  waiting   {job.get('pending_reason')}")
    print(f"  progress  {_progress(job)}\n  attempts  {job['attempts']}   ray job {_fmt(job.get('ray_job_id'))}")
    d = job["demand"]
    print(f"  gang      {d['workers']} x ({d['cpus_per_worker']:g} CPU, {d['gpus_per_worker']:g} GPU)")
    if job.get("failure_reason"):
        print(f"  failed    {job['failure_reason']}")
    for k, v in (job.get("summary") or {}).items():
        print(f"  {k:<22}{_fmt(v)}")
    return 0


def follow_one(c: Client, job_id: str) -> int:
    """A live progress bar over epochs with the latest losses; exits 0 only if the job succeeded."""
    from tqdm import tqdm

    epochs = (c.get(job_id)["spec"].get("training") or {}).get("epochs")
    bar = tqdm(total=epochs, desc=job_id, unit="epoch", dynamic_ncols=True, file=sys.stderr)
    final = "unknown"
    try:
        for event in c.events(job_id):
            d = event.data
            if event.kind == "metric":
                bar.n = int(d["epoch"]) + 1
                bar.set_postfix_str(f"train {_fmt(d.get('train_loss'))} test {_fmt(d.get('test_loss'))}")
            elif event.kind == "status" and "at" in d:
                bar.write(f"{job_id}: {d['state']}" + (f" ({d['reason']})" if d.get("reason") else ""),
                          file=sys.stderr)
            elif event.kind == "log" and d.get("level") == "error":
                bar.write(f"{job_id}: error: {d.get('message')}", file=sys.stderr)
            elif event.kind == "end":
                final = d["state"]
            bar.refresh()
    finally:
        bar.close()
    print(f"{job_id}  {final}")
    return 0 if final == "succeeded" else 1


def cmd_follow(args: argparse.Namespace) -> int:
    with _client(args) as c:
        return follow_one(c, args.id)


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as c:
        for job_id in args.ids:
            job = c.cancel(job_id)
            print(f"{job_id}  {job['state']}" + ("" if job["state"] == "cancelled" else "  (stopping)"))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    with _client(args) as c:
        png = c.plot(args.ids)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)
    print(f"wrote {out}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    import yaml

    spec = _spec_from(args)
    space_path = Path(args.space)
    if not space_path.exists():
        raise SystemExit(f"error: --space {space_path}: no such file (YAML: `teleport.lr: {{loguniform: [0.01, 1]}}`)")
    space = yaml.safe_load(space_path.read_text()) or {}
    body = {"base": spec, "search_space": space, "num_samples": args.num_samples, "metric": args.metric,
            "mode": args.mode, "scheduler": args.scheduler, "max_concurrent_trials": args.max_concurrent,
            "name": args.name or "", "priority": args.priority, "tags": args.tag}
    with _client(args) as c:
        job = c.json("POST", "/v1/sweeps", json=body)
        print(f"{job['id']}  {job['state']}  position {_fmt(job.get('queue_position'))}", flush=True)
        if not args.follow:
            return 0
        follow_one(c, job["id"])
        return show_sweep(c, job["id"])


def show_sweep(c: Client, sweep_id: str, as_json: bool = False) -> int:
    view = c.json("GET", f"/v1/sweeps/{sweep_id}")
    if as_json:
        print(json.dumps(view, indent=2))
        return 0
    job = view["job"]
    print(f"{job['id']}  {job['name']}  ({job['owner']})  {job['state']}"
          + (f"  ({job['failure_reason']})" if job.get("failure_reason") else ""))
    metric, best = view["metric"], view.get("best") or {}
    rows = [("TRIAL", "STATE", "EPOCHS", f"LAST {metric}", f"BEST {metric}", "CONFIG")]
    for t in view["trials"]:
        mark = "*" if t["trial"] == best.get("trial") else " "
        rows.append((f"{mark}{t['trial']}", t["state"], str(t["epochs"]), _fmt(t.get("last")), _fmt(t.get("best")),
                     " ".join(f"{k}={_fmt(v)}" for k, v in t["config"].items())))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r[:5], widths, strict=True)) + "  " + r[5])
    if best:
        print(f"best: {best['trial']} ({metric} {_fmt(best.get('best'))})")
    return 0 if job["state"] in ("succeeded", "queued", "starting", "running") else 1


def cmd_sweep_show(args: argparse.Namespace) -> int:
    with _client(args) as c:
        return show_sweep(c, args.id, args.json)


def cmd_sweeps(args: argparse.Namespace) -> int:
    with _client(args) as c:
        items = c.json("GET", "/v1/sweeps", params={"limit": args.limit})["items"]
    for j in items:
        print(f"{j['id']}  {j['state']:<10} {j['name'][:30]:<30} {j['owner']}")
    return 0


def cmd_get(path: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        with _client(args) as c:
            print(json.dumps(c.json("GET", path), indent=2))
        return 0

    return run


def cmd_compare(args: argparse.Namespace) -> int:
    from service.compare import cmd_compare as compare

    return compare(args, _spec_from(args), _client(args))


def cmd_demo(args: argparse.Namespace) -> int:
    from service.demo import main as demo

    return demo(Path(args.home) if args.home else Path("runs/demo"), args.epochs)


# ---- parser -----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tlab",
        description="Teleport Lab: teleportation with null-space gradient projection, on a shared Ray cluster.",
        epilog="`tlab COMMAND --help` shows a command's options. SPEC is a preset name or a YAML/JSON file.",
    )
    parser.add_argument("--url", default=None, help="the API (default: TLAB_URL, else the local `tlab up`)")
    parser.add_argument("--token", default=None, help="bearer token (default: TLAB_TOKEN, else the local admin's)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("up", help="start Redis, a Ray head, the API and the scheduler here; Ctrl-C stops them")
    p.add_argument("--port", type=int, default=None, help="API port (default: a free one)")
    p.add_argument("--home", default=None, help="data folder (default: TLAB_HOME or ~/.tlab)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs the local Ray head offers (default: all)")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("submit", help="queue an experiment: `tlab submit SPEC|--preset NAME [--set k=v] [--follow]`")
    p.add_argument("spec", nargs="?", help="a YAML/JSON spec file or a preset name")
    p.add_argument("--preset", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    p.add_argument("--name", default=None)
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--tag", action="append", default=[])
    p.add_argument("--follow", action="store_true", help="show live progress until it ends")
    p.add_argument("--dry-run", action="store_true", help="say whether and where it would fit; queue nothing")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("ls", help="your experiments, newest first")
    p.add_argument("--state", default=None)
    p.add_argument("--owner", default=None, help="(admins) someone else's")
    p.add_argument("--tag", default=None)
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("show", help="one experiment: state, why it waits, progress, summary")
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("follow", help="live progress bar and the latest metrics until the experiment ends")
    p.add_argument("id")
    p.set_defaults(func=cmd_follow)

    p = sub.add_parser("cancel", help="cancel queued or running experiments")
    p.add_argument("ids", nargs="+")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("plot", help="overlaid loss curves of experiments: `tlab plot ID... -o FILE.png`")
    p.add_argument("ids", nargs="+")
    p.add_argument("-o", "--output", default="curves.png")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("sweep", help="queue a hyperparameter sweep: `tlab sweep SPEC --space SPACE.yaml [--follow]`")
    p.add_argument("spec", nargs="?", help="the base spec: a YAML/JSON file or a preset name")
    p.add_argument("--preset", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    p.add_argument("--space", required=True, help="YAML: dotted spec path -> {loguniform|uniform|randint: [lo, hi]} "
                                                  "or {choice|grid: [values]}")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--metric", default="train_loss", choices=["train_loss", "test_loss", "test_acc"])
    p.add_argument("--mode", default="min", choices=["min", "max"])
    p.add_argument("--scheduler", default="fifo", choices=["fifo", "asha"])
    p.add_argument("--max-concurrent", type=int, default=1, help="trials at once (the sweep's gang)")
    p.add_argument("--name", default=None)
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--tag", action="append", default=[])
    p.add_argument("--follow", action="store_true", help="follow until it ends, then print the trials table")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("sweeps", help="your sweeps, newest first")
    p.add_argument("--limit", type=int, default=50)
    p.set_defaults(func=cmd_sweeps)

    p = sub.add_parser("sweep-show", help="a sweep's trials table and its best trial")
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_sweep_show)

    sub.add_parser("queue", help="the queue in start order, with why each job waits").set_defaults(
        func=cmd_get("/v1/queue"))
    sub.add_parser("cluster", help="nodes, free CPUs/GPUs, running experiments").set_defaults(
        func=cmd_get("/v1/cluster"))

    def spec_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("spec", nargs="?", help="a YAML/JSON spec file or a preset name")
        p.add_argument("--preset", default=None)
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")

    from service.compare import add_parser as add_compare

    add_compare(sub, spec_args, cmd_compare)

    p = sub.add_parser("demo", help="start the embedded stack, run digits with and without teleport through "
                                    "the API, follow both, plot and compare")
    p.add_argument("--home", default=None, help="stack data folder (default: runs/demo)")
    p.add_argument("--epochs", type=int, default=20)
    p.set_defaults(func=cmd_demo)

    for name, text in WORKER_COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def exec_worker_cli(argv: list[str]) -> None:
    """Replace this process with ``python -m workers.cli ARGV`` (same interpreter, same environment)."""
    os.execv(sys.executable, [sys.executable, "-m", "workers.cli", *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in WORKER_COMMANDS:
        exec_worker_cli(argv)
    if argv and argv[0] == "compare" and "--local" in argv:  # the in-process study
        exec_worker_cli([a for a in argv if a != "--local"])
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except ApiError as err:
        print(f"error: {err.detail}", file=sys.stderr)
        return 1
    except ValueError as err:  # SpecError: one line per wrong field
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
