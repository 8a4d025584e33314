"""Machines in the cluster: ``join-token`` (on the head, admin), ``join`` and ``leave`` (on the machine joining)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from service.cli.common import add_remote_args, client, fail, print_json, print_table

TOKEN_ENV = "TLAB_JOIN_TOKEN"


def cmd_join_token(args: argparse.Namespace) -> int:
    with client(args) as c:
        if args.revoke:
            c.request("DELETE", f"/v1/join-tokens/{args.revoke}")
            print(f"join token {args.revoke} revoked: no machine joins with it any more (nodes already joined "
                  "stay: `tlab leave` on them)")
            return 0
        if args.list:
            rows = c.json("GET", "/v1/join-tokens")
            if args.json:
                return print_json(rows)
            print_table([("ID", "CREATED", "JOINS", "NOTE")] + [
                (t["id"], time.strftime("%Y-%m-%d %H:%M", time.gmtime(t["created_at"])), str(t["joins"]), t["note"])
                for t in rows])
            return 0
        made = c.json("POST", "/v1/join-tokens", json={"note": args.note})
    if args.json:
        return print_json(made)
    print(made["secret"])
    print(f"join token {made['token']['id']}: on each machine, `{TOKEN_ENV}=<the line above> tlab join "
          f"{c.url}`; `tlab join-token --revoke {made['token']['id']}` stops it working", file=sys.stderr)
    return 0


def node_home(args: argparse.Namespace) -> Path:
    from service.cli.client import home

    return Path(args.home).expanduser() if args.home else home()


def service_user_for(home: Path) -> Any:
    """As root, the unprivileged user the node's Ray runs as (``TLAB_SERVICE_USER``), as ``tlab up``'s head."""
    from service.stack.up import service_user

    return service_user(home)


def cmd_join(args: argparse.Namespace) -> int:
    from service.stack.join import JoinRefused, join, run_node
    from service.stack.leave import drain_timeout

    token = os.environ.get(TOKEN_ENV, "").strip()
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
    home = node_home(args)
    try:
        node = join(home, args.head, token, args.address or "", args.num_cpus, args.num_gpus,
                    service_user_for(home), drain_timeout(args.drain_timeout))
    except (JoinRefused, ValueError) as err:  # (an AddressRefused is a ValueError; a bad TLAB_DRAIN_TIMEOUT_S too)
        fail(str(err))
    return run_node(node)


def cmd_leave(args: argparse.Namespace) -> int:
    from service.stack.join import JoinRefused, leave

    try:
        print(leave(node_home(args), args.wait))
    except JoinRefused as err:
        fail(str(err))
    return 0


def add_commands(sub: Any) -> None:
    p = sub.add_parser("join-token", help="make a join token a machine joins the cluster with (`tlab join`); "
                                          "--list, --revoke ID (admin)")
    p.add_argument("--note", default="", help="what it is for (the machines you hand it to)")
    p.add_argument("--list", action="store_true", help="list the join tokens not revoked")
    p.add_argument("--revoke", default="", metavar="ID", help="revoke a join token: no machine joins with it again")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_join_token)
    add_remote_args(p)

    p = sub.add_parser("join", help=f"join this machine to the cluster at HEAD (the API's URL) as a Ray node, with "
                                    f"the join token in {TOKEN_ENV}; Ctrl-C or `tlab leave` takes it out")
    p.add_argument("head", metavar="HEAD", help="the API as `tlab up --listen` printed it: http://ADDR:PORT")
    p.add_argument("--address", default="", help="this machine's IP the head reaches it at (default: the source "
                                                  "of its route to the head)")
    p.add_argument("--token-file", default="", help=f"read the join token from this file instead of {TOKEN_ENV}")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs this node offers (default: all)")
    p.add_argument("--num-gpus", type=int, default=None, help="GPUs this node offers (default: those Ray finds)")
    p.add_argument("--home", default=None, help="this node's folder (default: TLAB_HOME, else ~/.tlab; its Ray "
                                                "processes start in HOME/node)")
    p.add_argument("--drain-timeout", type=float, metavar="SECONDS", default=None,
                   help="when this node leaves (Ctrl-C, `tlab leave`), how long it waits for its jobs to move "
                        "elsewhere before it stops anyway (default: TLAB_DRAIN_TIMEOUT_S, else 120)")
    p.set_defaults(func=cmd_join)

    p = sub.add_parser("leave", help="take this machine's node out of the cluster: nothing new starts there, its "
                                     "jobs move elsewhere (resuming from their last checkpoint), then `tlab join` "
                                     "stops")
    p.add_argument("--home", default=None, help="the folder `tlab join` ran with (default: TLAB_HOME, else ~/.tlab)")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the node to stop, beyond the time "
                                                            "its jobs may take to move (`tlab join --drain-timeout`)")
    p.set_defaults(func=cmd_leave)
