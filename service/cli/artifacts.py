"""What a job leaves behind. ``tlab pull ID [-o DIR]``: an experiment's (or a sweep's best trial's) artifacts,
downloaded with a progress bar, each checked against the sha256 the API lists (recorded at export; a file it
has none for, e.g. one over the export's bound, against its size only). A file already there with that sha256 is
skipped; a ``.part`` left by an interrupted pull is continued with a Range request.
``tlab logs ID [-f] [--tail N] [--rank R] [--attempt A]``: what a rank printed, kept in storage."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from service.cli.common import add_remote_args, client, fail


def file_sha256(path: Path) -> str:
    """The file's sha256, as ``tlab pull`` checks it (``tlab.pull``, imported when called: ``tlab --help`` stays
    fast)."""
    from tlab.pull import file_sha256 as digest

    return digest(path)


def cmd_pull(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tlab.pull import fetch, target, to_fetch

    out = Path(args.output or args.id)
    with client(args) as c:
        items = c.json("GET", f"/v1/experiments/{args.id}/artifacts")["items"]
        if not items:
            print(f"{args.id} has no artifacts yet (they are written when it ends)")
            return 1
        todo = to_fetch(items, out)
        total = sum(i["bytes"] for i, _ in todo)
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"pull {args.id}",
                  disable=args.quiet) as bar:
            for item, dest in todo:
                fetch(c, args.id, item, dest, bar.update)
    for item in items:
        digest = (item.get("sha256") or "")[:12] or f"- ({item.get('sha256_note', 'none listed')})"
        print(f"{target(out, item['name'])}  {item['bytes']} bytes  sha256 {digest}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    import sys

    with client(args) as c:
        if not args.follow:
            sys.stdout.write(c.logs(args.id, args.rank, args.tail, args.attempt))
            return 0
        if args.tail is not None or args.attempt is not None:
            fail("--follow reads the whole log from its first attempt: leave out --tail and --attempt")
        for event in c.follow_logs(args.id, args.rank):
            if event.kind == "log":
                print(event.data, flush=True)
    return 0


def add_commands(sub: Any) -> None:
    p = sub.add_parser("pull", help="download an experiment's artifacts (a sweep's: its best trial's): "
                                    "`tlab pull ID [-o DIR]`")
    p.add_argument("id")
    p.add_argument("-o", "--output", default=None, help="directory to write them to (default: ./ID)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_pull)
    add_remote_args(p)
    p = sub.add_parser("logs", help="what a job's rank printed (kept after it ended): "
                                    "`tlab logs ID [-f] [--tail N] [--rank R]`")
    p.add_argument("id")
    p.add_argument("-f", "--follow", action="store_true", help="follow it until the job ends (across restarts)")
    p.add_argument("--tail", type=int, default=None, metavar="N", help="only the last N lines")
    p.add_argument("--rank", default="0", help="a worker's rank, `driver` (default 0; a 1-worker job's rank 0 "
                                               "is its driver), `preflight` (its code tried on one CPU first) or, "
                                               "for a sweep, `trial-<id>` (a trial's own output)")
    p.add_argument("--attempt", type=int, default=None, help="which start of the job (default: the newest)")
    p.set_defaults(func=cmd_logs)
    add_remote_args(p)
