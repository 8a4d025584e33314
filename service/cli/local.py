"""Runs in this process: ``run`` (``--local``/``--ray``), ``validate``, ``presets``, ``compare --local``.

They train or read specs with torch at hand, which ``service/`` never imports (DESIGN.md's walls), so ``tlab``
hands them to ``python -m workers.cli`` with ``exec``: the same interpreter and environment, a fresh process.
``presets --json`` is answered here (the same ``{name: {note, spec}}`` as ``GET /v1/presets``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

from service.cli.common import print_json

# command -> one-line help; each runs as `python -m workers.cli COMMAND ...` (its own --help has the details)
WORKER_COMMANDS = {
    "run": "train one spec in this process: `tlab run SPEC --local [--out DIR] [--set path=value ...]`",
    "presets": "list the presets (paper table rows and fast digits demos)",
    "validate": "print the normalized spec, or one line per wrong field",
}


def exec_worker_cli(argv: list[str]) -> NoReturn:
    """Replace this process with ``python -m workers.cli ARGV`` (same interpreter, same environment)."""
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "workers.cli", *argv])


def print_presets() -> int:
    from api_schemas.presets import PRESET_NOTES, PRESETS

    return print_json({name: {"note": PRESET_NOTES.get(name, ""), "spec": spec}
                       for name, spec in sorted(PRESETS.items())})


def hand_over(argv: list[str]) -> int | None:
    """Before parsing: run a worker command (never returns) or answer ``presets --json``; None for the rest."""
    if argv[:1] == ["presets"] and "--json" in argv:
        return print_presets()
    if argv and argv[0] in WORKER_COMMANDS:
        exec_worker_cli(argv)
    return None


def hand_over_parsed(args: argparse.Namespace) -> None:
    """After parsing: ``compare --local`` is the in-process study, without the service's options."""
    if getattr(args, "command", None) == "compare" and args.local:
        from service.cli.compare import local_argv

        exec_worker_cli(local_argv(args))


def add_commands(sub: Any) -> None:
    """Names only, for ``--help`` and completion: ``hand_over`` takes these before argparse sees them."""
    for name, text in WORKER_COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
