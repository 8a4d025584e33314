"""The stack and the shared cluster: ``up``, ``demo``, ``queue``, ``cluster``, and shell ``completion``."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from service.cli.common import add_read_command, cut, gang, get_json, print_json, print_table


def cmd_up(args: argparse.Namespace) -> int:
    from service.cli.client import home
    from service.stack.up import up

    return up(Path(args.home).expanduser() if args.home else home(), args.port, args.num_cpus, args.num_gpus,
              args.listen)


def cmd_demo(args: argparse.Namespace) -> int:
    from service.cli import demo

    return demo.main(Path(args.home) if args.home else Path("runs/demo"), args.epochs or demo.EPOCHS,
                     args.seeds or demo.SEEDS)


def cmd_queue(args: argparse.Namespace) -> int:
    items = get_json(args, "/v1/queue")["items"]
    if args.json:
        return print_json(items)
    if not items:
        print("the queue is empty")
        return 0
    rows = [("POS", "ID", "OWNER", "NAME", "PRIO", "GANG", "WHY IT WAITS")]
    rows += [(str(e["position"]), e["id"] or "-", e["owner"] or "(another user)", cut(e["name"] or "", 24),
              str(e["priority"]), gang(e["demand"]), e.get("pending_reason") or "") for e in items]
    print_table(rows)
    return 0


def _print_nodes(view: dict[str, Any]) -> None:
    rows = [("NODE", "ALIVE", "CPUS FREE/TOTAL", "GPUS FREE/TOTAL", "MEMORY GIB FREE/TOTAL", "GPU MODEL")]
    rows += [(node_name(n), alive(n), f"{n['cpus_free']:g}/{n['cpus_total']:g}",
              f"{n['gpus_free']:g}/{n['gpus_total']:g}", _memory(n), n.get("gpu_type") or "-") for n in view["nodes"]]
    print_table(rows)


def alive(node: dict[str, Any]) -> str:
    """yes, LEAVING (``tlab leave``: nothing new starts there, its jobs move) or DEAD (Ray declared it dead)."""
    return ("LEAVING" if node.get("leaving") else "yes") if node["alive"] else "DEAD"


def node_name(node: dict[str, Any]) -> str:
    """``host (address)`` as the scheduler knows it, else the Ray node id's first 12 characters."""
    host, address = node.get("hostname"), node.get("address")
    if host and address:
        return f"{host} ({address})"
    return host or address or node["id"][:12]


def _memory(node: dict[str, Any]) -> str:
    """Ray's memory on the node in GiB, free/total ('-': not known)."""
    total = node.get("memory_gb_total")
    return "-" if total is None else f"{node['memory_gb_free']:.1f}/{total:.1f}"


def _print_shares(view: dict[str, Any]) -> None:
    """Each running job's share of each node it runs on (a GPU count below 1: a share of a card)."""
    rows = [(s["job"], node_name(n), str(s["workers"]), f"{s['cpus']:g}", f"{s['gpus']:g}",
             "-" if s.get("memory_gb") is None else f"{s['memory_gb']:g}",
             "-" if s.get("gpu_memory_mb") is None else f"{s['gpu_memory_mb']:g}")
            for n in view["nodes"] for s in n.get("jobs") or []]
    if rows:
        print_table([("RUNNING", "NODE", "WORKERS", "CPUS", "GPUS", "MEMORY GIB", "GPU MIB"), *rows])


def cmd_cluster(args: argparse.Namespace) -> int:
    view = get_json(args, "/v1/cluster")
    if args.json:
        return print_json(view)
    if not view["scheduler_alive"]:
        print("no scheduler has reported the cluster yet (is `python -m service.scheduler` running?)")
    memory = ("" if view.get("memory_gb_total") is None else
              f"memory {view['memory_gb_free']:.1f} GiB free of {view['memory_gb_total']:.1f}   ")
    print(f"CPUs {view['cpus_free']:g} free of {view['cpus_total']:g}   "
          f"GPUs {view['gpus_free']:g} free of {view['gpus_total']:g}   {memory}"
          f"running {len(view['running_jobs'])}")
    print(f"sandbox {view.get('sandbox') or '-'}")  # where a job's code runs (docs/security.md)
    if view.get("cpus_outside") or view.get("gpus_outside") or view.get("memory_gb_outside"):
        held = f", {view['memory_gb_outside']:.1f} GiB" if view.get("memory_gb_outside") else ""
        print(f"Ray reports {view['cpus_outside']:g} CPUs, {view['gpus_outside']:g} GPUs{held} in use beyond Teleport "
              "Lab's running jobs (other Ray work, or a finished job's workers being released)")
    if view["nodes"]:
        _print_nodes(view)
    shown = {s["job"] for n in view["nodes"] for s in n.get("jobs") or []}
    _print_shares(view)
    for job_id in view["running_jobs"]:
        if job_id not in shown:  # (a job placed on nodes no longer listed)
            print(f"running  {job_id}")
    return 0


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for child in getattr(action, "choices", {}).values():
            yield from _parsers(child)


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab

    from service.cli import build_parser

    parser = build_parser()
    for p in _parsers(parser):  # file names where a file goes (SPEC is a file or a preset name)
        for action in p._actions:
            if action.dest in ("spec", "space", "output"):
                action.complete = shtab.FILE  # type: ignore[attr-defined]
    print(shtab.complete(parser, shell=args.shell), end="")
    return 0


def add_commands(sub: Any) -> None:
    p = sub.add_parser("up", help="start Redis, a Ray head, the API and the scheduler here and restart any that "
                                  "dies (TLAB_RESTART_*, TLAB_CRASH_LOOP_*); Ctrl-C stops them")
    p.add_argument("--port", type=int, default=None, help="API port (default: a free one)")
    p.add_argument("--listen", default="127.0.0.1", metavar="ADDR",
                   help="the address Redis, the Ray head and the API listen on, where other machines reach them "
                        "(`tlab join`); 0.0.0.0: the default route's (default: 127.0.0.1, this machine only)")
    p.add_argument("--home", default=None, help="data folder (default: TLAB_HOME, else ~/.tlab; root: /var/lib/tlab)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs the local Ray head offers (default: all)")
    p.add_argument("--num-gpus", type=int, default=None,
                   help="GPUs the local Ray head offers (default: those Ray finds; on a machine without them, "
                        "advertised only: jobs that ask for a share then train with training.device=cpu)")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("demo", help="start the embedded stack, run the paper's MNIST/SGD row on digits with and "
                                    "without teleport through the API (5 seeds, ~30-40 s a run), follow each, plot "
                                    "and compare")
    p.add_argument("--home", default=None, help="stack data folder (default: runs/demo)")
    p.add_argument("--epochs", type=int, default=None, help="epochs per run (default: the paper's 100)")
    p.add_argument("--seeds", type=int, default=None, help="seeds, each run with and without teleport (default: 5)")
    p.set_defaults(func=cmd_demo)

    add_read_command(sub, "queue", "the queue in start order, with why each job waits", cmd_queue)
    add_read_command(sub, "cluster", "nodes, free CPUs/GPUs, running experiments", cmd_cluster)

    p = sub.add_parser("completion", help="print a shell completion script: `eval \"$(tlab completion bash)\"`")
    p.add_argument("shell", choices=["bash", "zsh", "tcsh"])
    p.set_defaults(func=cmd_completion)
