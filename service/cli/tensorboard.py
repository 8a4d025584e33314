"""``tlab tensorboard ID... [-o DIR] [--no-start]``: pull the runs' TensorBoard event files into one directory (a
run directory per experiment, per sweep trial) and start TensorBoard on it if it is installed, else print the
command that would."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
from typing import Any

from service.cli.common import add_remote_args, client


def cmd_tensorboard(args: argparse.Namespace) -> int:
    with client(args) as c:
        out = c.tensorboard(args.ids, args.output)
    command = ["tensorboard", "--logdir", str(out), "--port", str(args.port)]
    print(f"{len(args.ids)} run(s) in {out}/")
    if args.no_start or not shutil.which("tensorboard"):
        hint = "" if args.no_start else "  (TensorBoard is not installed here: `pip install tensorboard`)"
        print(shlex.join(command) + hint)
        return 0
    print(shlex.join(command), flush=True)
    os.execvp(command[0], command)  # TensorBoard in this process's place: Ctrl-C stops it
    return 0  # not reached


def add_commands(sub: Any) -> None:
    p = sub.add_parser("tensorboard", help="pull experiments' and sweeps' TensorBoard files into one directory and "
                                           "start TensorBoard on it: `tlab tensorboard ID... [-o DIR]`")
    p.add_argument("ids", nargs="+", metavar="ID")
    p.add_argument("-o", "--output", default="tensorboard", help="the directory (default: ./tensorboard)")
    p.add_argument("--port", type=int, default=6006)
    p.add_argument("--no-start", action="store_true", help="only pull, and print the command that starts TensorBoard")
    p.set_defaults(func=cmd_tensorboard)
    add_remote_args(p)
