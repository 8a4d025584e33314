"""``tlab``: the command line, one module per command group, assembled here.

===============  ====================================================================================
``jobs``         ``submit``, ``ls``, ``show``, ``follow``, ``cancel``, ``rm``, ``plot``, ``compare``
``lineage``      ``continue``, ``fork``
``artifacts``    ``pull``, ``logs``
``tensorboard``  ``tensorboard``
``sweeps``       ``sweep``, ``sweeps``, ``sweep-show``, ``sweep-rerun``
``users``        ``users create|list``, ``me``, ``admin bootstrap`` (Redis directly, for deployments)
``stack``        ``up``, ``demo``, ``queue``, ``cluster``, ``completion``
``local``        ``run``, ``validate``, ``presets``, ``compare --local``: handed to ``workers.cli``
===============  ====================================================================================

Service commands talk to the REST API (``--url``/``TLAB_URL``, ``--token``/``TLAB_TOKEN``; by default the
local ``tlab up``); every read command takes ``--json``. Modules import heavy things (httpx, the spec
loader, shtab, tqdm) inside the commands, so ``tlab --help`` stays fast; nothing here imports torch,
teleport or workers (DESIGN.md's wall around ``service/``). argparse, not Typer: the README says why.
"""

from __future__ import annotations

import argparse
import os
import sys

from service.cli import artifacts, jobs, lineage, local, nodes, stack, sweeps, tensorboard, users

SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tlab",
        description="Teleport Lab: teleportation with null-space gradient projection, on a shared Ray cluster.",
        epilog="`tlab COMMAND --help` shows a command's options. SPEC is a preset name or a YAML/JSON file.",
    )
    parser.add_argument("--url", default=None, help="the API (default: TLAB_URL, else the local `tlab up`)")
    parser.add_argument("--token", default=None, help="bearer token (default: TLAB_TOKEN, else the local admin's)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for group in (stack, nodes, jobs, lineage, artifacts, tensorboard, sweeps, users, local):
        group.add_commands(sub)
    return parser


def run_command(args: argparse.Namespace) -> int:
    """The command's exit status; an API refusal or a wrong spec as one line on stderr."""
    try:
        return int(args.func(args))
    except ValueError as err:  # SpecError: one line per wrong field
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        from service.cli.client import ApiError  # imported by every command that can raise it

        if not isinstance(err, ApiError):
            raise
        print(f"error: {err.detail}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: what was submitted keeps running (`tlab ls`; `tlab cancel ID` stops it)", file=sys.stderr)
        return 130


def dispatch(argv: list[str]) -> int:
    handed = local.hand_over(argv)
    if handed is not None:
        return handed
    parser = build_parser()
    args = parser.parse_args(argv)
    local.hand_over_parsed(args)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return run_command(args)


def main(argv: list[str] | None = None) -> int:
    """``tlab ARGV``; a reader that leaves early (``tlab ls | head -1``) ends it quietly with 141."""
    try:
        code = dispatch(sys.argv[1:] if argv is None else list(argv))
        sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not at interpreter exit
        return code
    except BrokenPipeError:
        # the recipe of Python's signal docs: point stdout at devnull so the exit-time flush cannot fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return SIGPIPE_EXIT


if __name__ == "__main__":
    sys.exit(main())
