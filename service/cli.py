"""``tlab``: the command line.

Commands that train or read specs in this process (``run``, ``compare``, ``presets``,
``validate``) live in ``workers.cli`` and are handed over with ``exec`` so this module never
imports torch, teleport or workers (DESIGN.md's wall around ``service/``).
"""

from __future__ import annotations

import argparse
import os
import sys

# command -> one-line help; each runs as `python -m workers.cli COMMAND ...` (its own --help has the details)
WORKER_COMMANDS = {
    "run": "train one spec: `tlab run SPEC --local [--out DIR] [--set path=value ...]`",
    "compare": "with vs without teleport over seeds: `tlab compare SPEC [--seeds N] [--out DIR]`",
    "presets": "list the presets (paper table rows and fast digits demos)",
    "validate": "print the normalized spec, or one line per wrong field",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tlab",
        description="Teleport Lab: teleportation with null-space gradient projection, "
                    "on your own models and data.",
        epilog="`tlab COMMAND --help` shows a command's options. SPEC is a preset name or a YAML/JSON file.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is not None:  # service commands (set_defaults(func=...)) run here
        return int(args.func(args))
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
