"""``tlab``: the command line.

Service commands (``up``, ``submit``, ``ls``, ``show``, ``follow``, ``cancel``, ``plot``, ``sweep``,
``sweeps``, ``sweep-show``, ``compare``, ``queue``, ``cluster``, ``users``, ``me``, ``demo``) talk to the REST
API (``--url``/``TLAB_URL``, ``--token``/``TLAB_TOKEN``; by default the local ``tlab up``); every read command
takes ``--json``. ``admin bootstrap`` talks to Redis directly (deployments run it before the API starts);
``completion`` prints a shell completion script. Commands that train or
read specs in this process (``run``, ``compare --local``, ``presets``, ``validate``) live in ``workers.cli``
and are handed over with ``exec`` so this module never imports torch, teleport or workers
(DESIGN.md's wall around ``service/``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
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
# the commands that talk to the API: they take --url/--token after the command name too
SERVICE_COMMANDS = {"submit", "ls", "show", "follow", "cancel", "plot", "sweep", "sweeps", "sweep-show", "compare",
                    "queue", "cluster", "me"}


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


def _print_table(rows: list[tuple[str, ...]]) -> None:
    """Columns padded to their widest cell; the last one is left ragged (it holds free text)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1])


def _print_json(data: Any) -> int:
    print(json.dumps(data, indent=2))
    return 0


def _gang(demand: dict[str, Any]) -> str:
    return f"{demand['workers']} x ({demand['cpus_per_worker']:g} CPU, {demand['gpus_per_worker']:g} GPU)"


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
    _print_table(rows)
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
    print(f"  gang      {_gang(job['demand'])}")
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
            "searcher": args.searcher, "seed": args.seed, "grace_period": args.grace_period,
            "perturbation_interval": args.perturbation_interval, "name": args.name or "", "priority": args.priority,
            "tags": args.tag}
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
        state = t["state"] + (f" (PBT moves: {t['perturbed']})" if t.get("perturbed") else "")
        rows.append((f"{mark}{t['trial']}", state, str(t["epochs"]), _fmt(t.get("last")), _fmt(t.get("best")),
                     " ".join(f"{k}={_fmt(v)}" for k, v in t["config"].items())))
    _print_table(rows)
    if best:
        print(f"best: {best['trial']} ({metric} {_fmt(best.get('best'))})")
    return 0 if job["state"] in ("succeeded", "queued", "starting", "running") else 1


def cmd_sweep_show(args: argparse.Namespace) -> int:
    with _client(args) as c:
        return show_sweep(c, args.id, args.json)


def cmd_sweeps(args: argparse.Namespace) -> int:
    with _client(args) as c:
        items = c.json("GET", "/v1/sweeps", params={"limit": args.limit})["items"]
    if args.json:
        return _print_json(items)
    for j in items:
        print(f"{j['id']}  {j['state']:<10} {j['name'][:30]:<30} {j['owner']}")
    return 0


def cmd_queue(args: argparse.Namespace) -> int:
    with _client(args) as c:
        items = c.json("GET", "/v1/queue")["items"]
    if args.json:
        return _print_json(items)
    if not items:
        print("the queue is empty")
        return 0
    rows = [("POS", "ID", "OWNER", "NAME", "PRIO", "GANG", "WHY IT WAITS")]
    rows += [(str(e["position"]), e["id"], e["owner"], e["name"][:24], str(e["priority"]), _gang(e["demand"]),
              e.get("pending_reason") or "") for e in items]
    _print_table(rows)
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    with _client(args) as c:
        view = c.json("GET", "/v1/cluster")
    if args.json:
        return _print_json(view)
    if not view["scheduler_alive"]:
        print("no scheduler has reported the cluster yet (is `python -m service.scheduler` running?)")
    print(f"CPUs {view['cpus_free']:g} free of {view['cpus_total']:g}   "
          f"GPUs {view['gpus_free']:g} free of {view['gpus_total']:g}   "
          f"running {len(view['running_jobs'])}")
    if view.get("cpus_outside") or view.get("gpus_outside"):
        print(f"Ray reports {view['cpus_outside']:g} CPUs, {view['gpus_outside']:g} GPUs in use beyond Teleport "
              "Lab's running jobs (other Ray work, or a finished job's workers being released)")
    if view["nodes"]:
        rows = [("NODE", "ALIVE", "CPUS FREE/TOTAL", "GPUS FREE/TOTAL")]
        rows += [(n["id"], "yes" if n["alive"] else "no", f"{n['cpus_free']:g}/{n['cpus_total']:g}",
                  f"{n['gpus_free']:g}/{n['gpus_total']:g}") for n in view["nodes"]]
        _print_table(rows)
    for job_id in view["running_jobs"]:
        print(f"running  {job_id}")
    return 0


# ---- users -------------------------------------------------------------------------------------------


def _quota_text(quotas: dict[str, Any]) -> str:
    return "  ".join(f"{k} {_fmt(v)}" for k, v in quotas.items())


def _quota_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # the API names the field if a string is wrong here


def cmd_users_create(args: argparse.Namespace) -> int:
    quotas: dict[str, Any] = {}
    for item in args.quota:
        field, sep, value = item.partition("=")
        if not sep or not field:
            raise SystemExit(f"error: --quota {item!r}: expected FIELD=VALUE, e.g. --quota max_gpus=4")
        quotas[field.strip()] = _quota_value(value.strip())
    if args.max_gpus is not None:
        quotas["max_gpus"] = args.max_gpus
    if args.max_running_jobs is not None:
        quotas["max_running_jobs"] = args.max_running_jobs
    body: dict[str, Any] = {"name": args.name, "role": args.role}
    if quotas:
        body["quotas"] = quotas
    with _client(args) as c:
        created = c.json("POST", "/v1/users", json=body)
    if args.json:
        return _print_json(created)
    user = created["user"]
    print(f"{user['name']}  {user['role']}  {_quota_text(user['quotas'])}")
    print(f"token  {created['token']}")
    print("the token is shown only now (Redis keeps its hash): the user sets TLAB_TOKEN to it", file=sys.stderr)
    return 0


def cmd_users_list(args: argparse.Namespace) -> int:
    with _client(args) as c:
        users = c.json("GET", "/v1/users")
    if args.json:
        return _print_json(users)
    rows = [("NAME", "ROLE", "CREATED", "QUOTAS")]
    rows += [(u["name"], u["role"], time.strftime("%Y-%m-%d %H:%M", time.localtime(u["created_at"])),
              _quota_text(u["quotas"])) for u in users]
    _print_table(rows)
    return 0


def cmd_me(args: argparse.Namespace) -> int:
    with _client(args) as c:
        me = c.json("GET", "/v1/me")
    if args.json:
        return _print_json(me)
    print(f"{me['name']}  {me['role']}  {_quota_text(me['quotas'])}  at {c.url}")
    return 0


def cmd_admin_bootstrap(args: argparse.Namespace) -> int:
    """Create the admin user, or point its token at ``TLAB_ADMIN_TOKEN``, straight in Redis (safe to repeat)."""
    import redis

    from service.store import Store

    token = os.environ.get("TLAB_ADMIN_TOKEN", "").strip()
    if not token:
        raise SystemExit("error: TLAB_ADMIN_TOKEN is empty: set it (compose: .env; Kubernetes: the admin-token "
                         "key of Secret tlab-secrets) to the admin's bearer token")
    url = args.redis_url or os.environ.get("REDIS_URL", "")
    if not url:
        raise SystemExit("error: REDIS_URL is not set: give --redis-url redis://HOST:6379/0 or set REDIS_URL")
    store = Store.from_url(url)
    try:
        existing = store.user(args.name)
        if existing is not None and existing.role != "admin":
            raise SystemExit(f"error: --name: user {args.name!r} exists with role {existing.role}, not admin: "
                             "pick another name")
        store.ensure_admin(args.name, token)
    except redis.RedisError as err:
        raise SystemExit(f"error: REDIS_URL: cannot use Redis: {err}") from None
    print(f"admin {args.name!r} {'token re-pointed' if existing else 'created'}; it signs in with TLAB_ADMIN_TOKEN")
    return 0


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for child in getattr(action, "choices", {}).values():
            yield from _parsers(child)


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab

    parser = build_parser()
    for p in _parsers(parser):  # file names where a file goes (SPEC is a file or a preset name)
        for action in p._actions:
            if action.dest in ("spec", "space", "output"):
                action.complete = shtab.FILE  # type: ignore[attr-defined]
    print(shtab.complete(parser, shell=args.shell), end="")
    return 0


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
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="PATH=VALUE")
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
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="PATH=VALUE")
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
    p.add_argument("--follow", action="store_true", help="follow until it ends, then print the trials table")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("sweeps", help="your sweeps, newest first")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_sweeps)

    p = sub.add_parser("sweep-show", help="a sweep's trials table and its best trial")
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_sweep_show)

    p = sub.add_parser("queue", help="the queue in start order, with why each job waits")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_queue)

    p = sub.add_parser("cluster", help="nodes, free CPUs/GPUs, running experiments")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_cluster)

    add_user_commands(sub)

    def spec_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("spec", nargs="?", help="a YAML/JSON spec file or a preset name")
        p.add_argument("--preset", default=None)
        p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="PATH=VALUE")

    from service.compare import add_parser as add_compare

    add_compare(sub, spec_args, cmd_compare)

    p = sub.add_parser("demo", help="start the embedded stack, run digits with and without teleport through "
                                    "the API, follow both, plot and compare")
    p.add_argument("--home", default=None, help="stack data folder (default: runs/demo)")
    p.add_argument("--epochs", type=int, default=20)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("completion", help="print a shell completion script: `eval \"$(tlab completion bash)\"`")
    p.add_argument("shell", choices=["bash", "zsh", "tcsh"])
    p.set_defaults(func=cmd_completion)

    for name, text in WORKER_COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    for name, p in sub.choices.items():  # `tlab ls --url U` as well as `tlab --url U ls`
        if name in SERVICE_COMMANDS and "--url" not in p._option_string_actions:
            add_remote_args(p)
    return parser


def add_remote_args(p: argparse.ArgumentParser) -> None:
    """``--url``/``--token`` after the command too; SUPPRESS keeps a value given before the command."""
    p.add_argument("--url", default=argparse.SUPPRESS, help="the API (default: TLAB_URL, else the local `tlab up`)")
    p.add_argument("--token", default=argparse.SUPPRESS, help="bearer token (default: TLAB_TOKEN)")


def add_user_commands(sub: Any) -> None:
    users = sub.add_parser("users", help="(admins) create users with quotas, list them")
    users_sub = users.add_subparsers(dest="users_command", metavar="ACTION", required=True)
    p = users_sub.add_parser("create", help="create a user; prints its token once")
    p.add_argument("name", help="lower-case login name")
    p.add_argument("--role", default="user", choices=["user", "admin"])
    p.add_argument("--max-gpus", type=float, default=None, help="GPUs its starting/running jobs may hold at once")
    p.add_argument("--max-running-jobs", type=int, default=None, help="jobs it may have starting/running at once")
    p.add_argument("--quota", action="append", default=[], metavar="FIELD=VALUE",
                   help="any quota field the API takes (GET /docs: Quotas)")
    p.add_argument("--json", action="store_true", help="print {user, token} as JSON")
    p.set_defaults(func=cmd_users_create)
    p = users_sub.add_parser("list", help="every user, role and quotas")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_users_list)
    for p in users_sub.choices.values():
        add_remote_args(p)

    p = sub.add_parser("me", help="who the token belongs to, and its quotas")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_me)

    admin = sub.add_parser("admin", help="deployment chores that talk to Redis directly")
    admin_sub = admin.add_subparsers(dest="admin_command", metavar="ACTION", required=True)
    p = admin_sub.add_parser("bootstrap", help="create the admin user, or point its token at TLAB_ADMIN_TOKEN "
                                               "(REDIS_URL); safe to run at every start")
    p.add_argument("--name", default="admin", help="the admin's user name (default: admin)")
    p.add_argument("--redis-url", default=None, help="default: REDIS_URL")
    p.set_defaults(func=cmd_admin_bootstrap)


def exec_worker_cli(argv: list[str]) -> None:
    """Replace this process with ``python -m workers.cli ARGV`` (same interpreter, same environment)."""
    os.execv(sys.executable, [sys.executable, "-m", "workers.cli", *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["presets"] and "--json" in argv:  # the same {name: {note, spec}} as GET /v1/presets
        from api_schemas.presets import PRESET_NOTES, PRESETS

        return _print_json({name: {"note": PRESET_NOTES.get(name, ""), "spec": spec}
                            for name, spec in sorted(PRESETS.items())})
    if argv and argv[0] in WORKER_COMMANDS:
        exec_worker_cli(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "compare" and args.local:  # the in-process study: no service options
        from service.compare import local_argv

        exec_worker_cli(local_argv(args))
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
