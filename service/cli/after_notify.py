"""``--after ID`` and ``--notify URL [--notify-on STATES]``: the dependency and webhook options of ``submit`` and
``sweep`` (the body's ``after`` and ``notify``; docs/spec.md, "Beside the spec")."""

from __future__ import annotations

import argparse
from typing import Any

from service.cli.common import fail

# api_schemas.notify.NOTIFY_STATES, spelt out: pydantic here would slow `tlab --help` (a test keeps them equal)
NOTIFY_STATES = ("succeeded", "failed", "cancelled", "preempted")


def notify_states(text: str) -> list[str]:
    """``failed,cancelled`` -> the states, each one checked (argparse's one-line error names a wrong one)."""
    states = [s.strip() for s in text.split(",") if s.strip()]
    wrong = [s for s in states if s not in NOTIFY_STATES]
    if wrong or not states:
        raise argparse.ArgumentTypeError(f"{','.join(wrong) or repr(text)}: give states among "
                                         f"{', '.join(NOTIFY_STATES)} (comma-separated)")
    return states


def add_after_notify(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--after", action="append", default=[], metavar="ID",
                   help=f"start the {what} only once job ID has succeeded (repeat for several); it fails if one fails")
    p.add_argument("--notify", metavar="URL", default=None,
                   help=f"POST a signed JSON to URL when the {what} ends (or is preempted); see --notify-on")
    p.add_argument("--notify-on", metavar="STATES", type=notify_states, action="extend", default=None,
                   help=f"which of {','.join(NOTIFY_STATES)} send it (comma-separated; default: all four)")


def after_notify(args: argparse.Namespace) -> dict[str, Any]:
    """The body's ``after``/``notify`` from the options (empty when none was given)."""
    if args.notify_on and not args.notify:
        fail("--notify-on: give --notify URL too (where to POST)")
    notify = {"webhook": args.notify} | ({"on": list(dict.fromkeys(args.notify_on))} if args.notify_on else {})
    return ({"after": args.after} if args.after else {}) | ({"notify": notify} if args.notify else {})
