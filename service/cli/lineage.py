"""Lineage on the service: ``continue`` (more epochs from an ended experiment's final checkpoint) and ``fork``
(a new run from the checkpoint after an epoch, some fields changed). Both queue a child experiment whose
``parent`` is the given one; ``tlab show`` prints a job's parent and children."""

from __future__ import annotations

import argparse
from typing import Any

from service.cli.common import add_remote_args, client, fail, fmt
from service.cli.jobs import follow_one


def set_fields(items: list[str]) -> dict[str, Any]:
    """``--set teleport.tau=0.99 --set optimizer.lr=0.05`` -> ``{"teleport.tau": 0.99, "optimizer.lr": 0.05}``
    (values read as YAML scalars or lists, as ``tlab submit --set`` reads them)."""
    from api_schemas.spec_io import parse_value

    out: dict[str, Any] = {}
    for item in items:
        path, eq, raw = item.partition("=")
        if not eq or not path.strip():
            fail(f"--set {item!r}: write it as PATH=VALUE, e.g. --set teleport.tau=0.99")
        out[path.strip()] = parse_value(raw)
    return out


def queue_child(args: argparse.Namespace, route: str, body: dict[str, Any]) -> int:
    """POST the child; print its id, its parent and where it starts; follow it with ``--follow``."""
    with client(args) as c:
        job = c.json("POST", f"/v1/experiments/{args.id}/{route}", json=body)
        print(f"{job['id']}  {job['state']}  from {job['parent']} after epoch {job['parent_epoch']}, "
              f"{job['spec']['training']['epochs']} epochs in all, position {fmt(job.get('queue_position'))}",
              flush=True)
        return follow_one(c, job["id"]) if args.follow else 0


def cmd_continue(args: argparse.Namespace) -> int:
    return queue_child(args, "continue", {"epochs": args.epochs})


def cmd_fork(args: argparse.Namespace) -> int:
    return queue_child(args, "fork", {"from_epoch": args.from_epoch, "set": set_fields(args.set)})


def add_commands(sub: Any) -> None:
    p = sub.add_parser("continue", help="train an ended experiment N more epochs from its final checkpoint: "
                                        "`tlab continue ID --epochs 50 [--follow]`")
    p.add_argument("id")
    p.add_argument("--epochs", type=int, required=True, help="epochs to train after the parent's last one")
    p.add_argument("--follow", action="store_true", help="show live progress until it ends")
    p.set_defaults(func=cmd_continue)
    add_remote_args(p)

    p = sub.add_parser("fork", help="a new run from an ended experiment's checkpoint after an epoch, some fields "
                                    "changed: `tlab fork ID --from-epoch 10 --set teleport.tau=0.99`")
    p.add_argument("id")
    p.add_argument("--from-epoch", type=int, required=True, help="a kept checkpoint's epoch (a wrong one lists them)")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="a field to change (repeat); model, dataset, code, training.dtype, optimizer.name cannot")
    p.add_argument("--follow", action="store_true", help="show live progress until it ends")
    p.set_defaults(func=cmd_fork)
    add_remote_args(p)
