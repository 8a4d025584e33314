"""Experiments on the service: ``submit``, ``ls``, ``show``, ``follow``, ``cancel``, ``rm``, ``plot``, ``compare``."""

from __future__ import annotations

import argparse
import sys
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
    fmt,
    gang,
    print_json,
    print_table,
    progress,
    spec_from,
)
from service.cli.compare import add_parser as add_compare  # stdlib only at import: `tlab --help` stays fast

if TYPE_CHECKING:
    from service.cli.client import Client

DRY_RUN_WAIT_S = 600.0  # above any preflight time box a service sets (its default: 120 s)


def cmd_submit(args: argparse.Namespace) -> int:
    from service.cli.code_zip import with_code

    spec = spec_from(args)
    with client(args) as c:
        spec = with_code(c, spec, args.code)
        if args.dry_run:
            r = c.json("POST", "/v1/experiments", params={"dry_run": "true"}, json={"spec": spec},
                       timeout=DRY_RUN_WAIT_S)  # a spec with code waits for its preflight (TLAB_PREFLIGHT_TIMEOUT_S)
            print_json(r)
            return 0 if r["fits_ever"] else 1
        follow_ups = after_notify(args)
        if follow_ups:  # the fields the client's submit() does not carry
            body = {"spec": spec, "name": args.name or "", "priority": args.priority, "tags": args.tag, **follow_ups}
            job = c.json("POST", "/v1/experiments", json=body)
        else:
            job = c.submit(spec, name=args.name or "", priority=args.priority, tags=args.tag)
        print(f"{job['id']}  {job['state']}  position {fmt(job.get('queue_position'))}", flush=True)
        return follow_one(c, job["id"]) if args.follow else 0


def _note(job: dict[str, Any]) -> str:
    """Why a job waits, why it failed, or its result: the free-text column of ``tlab ls``."""
    if job["state"] == "succeeded" and job.get("summary"):
        return f"test loss {fmt(job['summary'].get('final_test_loss'))}"
    return job.get("pending_reason") or job.get("failure_reason") or ""


def cmd_ls(args: argparse.Namespace) -> int:
    with client(args) as c:
        jobs = c.list(state=args.state, owner=args.owner, tag=args.tag, limit=args.limit)
    if args.json:
        return print_json(jobs)
    rows = [("ID", "NAME", "OWNER", "STATE", "PROGRESS", "WHY / RESULT")]
    rows += [(j["id"], cut(j["name"], 24), j["owner"], j["state"], progress(j), _note(j)) for j in jobs]
    print_table(rows)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with client(args) as c:
        job = c.get(args.id)
    if args.json:
        return print_json(job)
    print(f"{job['id']}  {job['name']}  ({job['owner']})\n  state     {job['state']}")
    if job["state"] == "queued":
        print(f"  position  {fmt(job.get('queue_position'))}\n  waiting   {job.get('pending_reason')}")
    print(f"  progress  {progress(job)}\n  attempts  {job['attempts']}   ray job {fmt(job.get('ray_job_id'))}")
    print(f"  gang      {gang(job['demand'])}")
    if job.get("preemptions"):
        print(f"  preempted {job['preemptions']} time(s), last: {job.get('last_preemption')}")
    if job.get("failure_reason"):
        print(f"  failed    {job['failure_reason']}")
    for line in preflight_lines(job.get("preflight")):
        print(f"  {line}")
    if job.get("parent"):
        print(f"  parent    {job['parent']} (from its checkpoint after epoch {fmt(job.get('parent_epoch'))})")
    if job.get("children"):
        print(f"  children  {' '.join(job['children'])}")
    summary = job.get("summary") or {}
    width = max((len(k) for k in summary), default=0) + 2  # the longest name still leaves a gap
    for k, v in summary.items():
        print(f"  {k:<{width}}{fmt(v)}")
    return 0


def preflight_lines(pf: dict[str, Any] | None) -> list[str]:
    """A preflight's result as ``tlab show`` prints it: the verdict, then what it measured."""
    if not pf:
        return []
    took = [f"in {pf['wall_seconds']:.1f} s"] if pf.get("wall_seconds") is not None else []  # what the job waited
    if pf.get("seconds") is not None:
        took.append(f"({pf['seconds']:.1f} s of it its own work)" if took else f"in {pf['seconds']:.1f} s")
    lines = [" ".join([f"preflight {pf['state']}", *took]) + (f": {pf['error']}" if pf.get("error") else "")]
    if pf.get("entrypoint"):
        lines.append(f"  entrypoint {pf['entrypoint']} imported, takes one argument")
    if pf.get("params") is not None:
        lines.append(f"  model {pf['params']:,} parameters; data {fmt(pf.get('train_size'))} train, "
                     f"{fmt(pf.get('test_size'))} test, x {tuple(pf.get('sample_shape') or ())} ({pf.get('task')})")
    if pf.get("teleport"):
        lines.append(f"  teleport {pf['teleport']} at tau {fmt(pf.get('tau'))}: {fmt(pf.get('free_directions'))} "
                     f"free directions in {len(pf.get('layers') or [])} layer(s)")
        lines += [f"    {layer['name']:<28} {layer['free']:>6} free of {layer['input_dim']}"
                  for layer in pf.get("layers") or []]
        lines += [f"    {name:<28} untouched: {why}" for name, why in (pf.get("untouched") or {}).items()]
        if pf.get("step_advice"):
            lines.append(f"  teleport step: {pf['step_advice']}")
    return lines


def follow_one(c: Client, job_id: str, trials: int = 1) -> int:
    """A live progress bar over epochs with the latest losses (on a terminal; into a pipe or a log, one plain line
    per epoch instead, no cursor codes); exits 0 only if the job succeeded. A sweep's ``trials`` share one bar:
    every trial's epochs add up on it."""
    from tqdm import tqdm

    epochs = (c.get(job_id)["spec"].get("training") or {}).get("epochs")
    tty = sys.stderr.isatty()
    bar = tqdm(total=epochs * trials if epochs else None, desc=job_id, unit="epoch", dynamic_ncols=True,
               file=sys.stderr, disable=not tty)
    done: dict[str, int] = {}  # epochs trained, per trial ("": an experiment's own)
    final = "unknown"
    try:
        for event in c.events(job_id):
            d = event.data
            if event.kind == "metric":
                trial = str(d.get("trial") or "")
                done[trial] = int(d["epoch"]) + 1
                bar.n = sum(done.values())
                losses = (f"train {fmt(d.get('train_loss'))} test {fmt(d.get('test_loss'))}"
                          + (f" lr {fmt(d['lr'])}" if d.get("lr") is not None else ""))
                bar.set_postfix_str(losses)
                if not tty:
                    where = f"epoch {done[trial]}/{epochs or '?'}"
                    if trial:  # a sweep's line: the trial's epoch, and where the whole sweep is
                        where = f"trial {trial} {where} ({bar.n}/{bar.total or '?'} in all)"
                    print(f"{job_id} {where} {losses}", file=sys.stderr, flush=True)
            elif event.kind == "status" and d.get("kind") in ("budget", "hint") and d.get("message"):
                bar.write(f"{job_id}: {d['kind']}: {d['message']}", file=sys.stderr)  # the run's own advice
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
    with client(args) as c:
        return follow_one(c, args.id)


def cmd_cancel(args: argparse.Namespace) -> int:
    with client(args) as c:
        for job_id in args.ids:
            job = c.cancel(job_id)
            print(f"{job_id}  {job['state']}" + ("" if job["state"] == "cancelled" else "  (stopping)"))
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    with client(args) as c:
        for job_id in args.ids:
            c.delete(job_id)
            print(f"{job_id}  deleted")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    with client(args) as c:
        png = c.plot(args.ids, x=args.x)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)
    print(f"wrote {out}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """The study as a sweep on the service; ``--local`` never gets here (``tlab`` hands it to workers.cli)."""
    from service.cli.code_zip import with_code
    from service.cli.compare import cmd_compare as compare

    spec = spec_from(args)
    if args.code:
        with client(args) as c:
            spec = with_code(c, spec, args.code)  # every trial's code.package
    return compare(args, spec, client(args))


def add_commands(sub: Any) -> None:
    p = sub.add_parser("submit", help="queue an experiment: `tlab submit SPEC|--preset NAME [--set k=v] [--follow]`")
    add_spec_args(p)
    p.add_argument("--name", default=None)
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--tag", action="append", default=[])
    add_after_notify(p, "experiment")
    p.add_argument("--follow", action="store_true", help="show live progress until it ends")
    p.add_argument("--dry-run", action="store_true",
                   help="say whether and where it would fit (a spec with your code: its preflight on Ray too); queue "
                        "nothing")
    add_code_arg(p)
    p.set_defaults(func=cmd_submit)

    add_read_command(sub, "ls", "your experiments, newest first", cmd_ls,
                     options={"--state": {}, "--owner": {"help": "(admins) someone else's"}, "--tag": {},
                              "--limit": {"type": int, "default": 50}})
    add_read_command(sub, "show", "one experiment: state, why it waits, progress, summary", cmd_show, "id")

    p = sub.add_parser("follow", help="live progress bar and the latest metrics until the experiment ends")
    p.add_argument("id")
    p.set_defaults(func=cmd_follow)

    p = sub.add_parser("cancel", help="cancel queued or running experiments or sweeps (their records stay)")
    p.add_argument("ids", nargs="+")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("rm", help="delete ended experiments or sweeps: records, metrics, logs, checkpoints, artifacts")
    p.add_argument("ids", nargs="+")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("plot", help="overlaid loss curves of experiments: `tlab plot ID... -o FILE.png [--x seconds]`")
    p.add_argument("ids", nargs="+")
    p.add_argument("-o", "--output", default="curves.png")
    p.add_argument("--x", choices=("epoch", "seconds"), default="epoch",
                   help="x axis: epochs trained (default) or wall-clock seconds, teleport included")
    p.set_defaults(func=cmd_plot)

    add_compare(sub, add_spec_args, cmd_compare)
    for name in ("submit", "follow", "cancel", "rm", "plot", "compare"):
        add_remote_args(sub.choices[name])
