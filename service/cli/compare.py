"""``tlab compare SPEC --seeds N``: "does teleport help on my model?" asked of the service.

Submits one sweep, a grid over ``teleport.enabled`` × ``training.seed``, so the study is queued,
scheduled and resumed like any job; shows its progress; then prints the service's study table
(mean ± std over seeds: final losses, epochs and seconds to ``training.target_loss``) and writes
DIR/compare.png (the band plot), DIR/compare.json (the study) and DIR/sweep.json (the trials).
``tlab compare --local`` runs the same study in this process instead (``workers.cli``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # `tlab --help` builds this parser: the HTTP client is imported by the commands that use it
    from service.cli.client import Client

TERMINAL = {"succeeded", "failed", "cancelled"}


def study_body(spec: dict[str, Any], seeds: int, max_concurrent: int, name: str) -> dict[str, Any]:
    space = {"teleport.enabled": {"grid": [True, False]}, "training.seed": {"grid": list(range(seeds))}}
    return {"base": spec, "name": name, "searcher": "grid", "scheduler": "fifo", "metric": "train_loss",
            "mode": "min", "max_concurrent_trials": max_concurrent, "search_space": space, "tags": ["compare"]}


def wait_for(c: Client, sweep_id: str, trials: int, epochs: int, poll_s: float = 1.0,
             progress: bool = True) -> dict[str, Any]:
    """Poll the sweep until it ends: a bar over every trial's epochs (on a terminal only: no cursor codes in a pipe
    or a log), a line per trial state change."""
    from tqdm import tqdm

    bar = tqdm(total=trials * epochs, unit="epoch", disable=not (progress and sys.stderr.isatty()), file=sys.stderr,
               dynamic_ncols=True)
    states: dict[str, str] = {}
    try:
        while True:
            view = c.json("GET", f"/v1/sweeps/{sweep_id}")
            for t in view["trials"]:
                if states.get(t["trial"]) != t["state"]:
                    states[t["trial"]] = t["state"]
                    config = " ".join(f"{k}={v}" for k, v in t["config"].items())
                    bar.write(f"  {t['trial']}  {t['state']:<13} {config}")
            bar.n = sum(t["epochs"] for t in view["trials"])
            job = view["job"]
            done = sum(t["state"] in ("succeeded", "stopped early", "failed") for t in view["trials"])
            bar.set_postfix_str(f"{job['state']}, trials {done}/{trials}")
            bar.refresh()
            if job["state"] in TERMINAL:
                return view
            time.sleep(poll_s)
    finally:
        bar.close()


def cmd_compare(args: argparse.Namespace, spec: dict[str, Any], client: Client) -> int:
    if args.seeds < 1:
        raise SystemExit("error: --seeds must be at least 1")
    out = Path(args.out) if args.out else Path("runs") / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
    name = args.name or f"compare {args.preset or Path(args.spec).stem} × {args.seeds} seeds"
    started = time.monotonic()
    with client as c:
        job = c.json("POST", "/v1/sweeps", json=study_body(spec, args.seeds, args.max_concurrent, name))
        sweep_id = job["id"]
        print(f"{sweep_id}  {job['state']}  (sweep of {2 * args.seeds} trials; `tlab sweep-show {sweep_id}`)",
              file=sys.stderr, flush=True)
        view = wait_for(c, sweep_id, 2 * args.seeds, spec["training"]["epochs"], progress=not args.no_progress)
        study = c.json("GET", f"/v1/sweeps/{sweep_id}/study")
        png = c.request("GET", f"/v1/sweeps/{sweep_id}/plot.png").content
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.png").write_bytes(png)
    (out / "compare.json").write_text(json.dumps({"sweep": sweep_id, "spec": spec, **study}, indent=2) + "\n")
    (out / "sweep.json").write_text(json.dumps(view, indent=2) + "\n")
    state = view["job"]["state"]
    if args.json:
        print(json.dumps(study, indent=2))
    else:
        print(study["table"])
        took = time.monotonic() - started
        print(f"wrote {out / 'compare.png'}, {out / 'compare.json'} (the study took {took:.0f} s)")
    if state != "succeeded":
        reason = view["job"].get("failure_reason") or state
        print(f"error: sweep {sweep_id} {state}: {reason}", file=sys.stderr)
        return 1
    return 0


def local_argv(args: argparse.Namespace) -> list[str]:
    """``tlab compare ... --local`` as ``workers.cli compare`` takes it (the service's options left out)."""
    source = args.preset or args.spec
    if not source:
        raise SystemExit("error: give a SPEC file or --preset NAME (`tlab presets` lists them)")
    argv = ["compare", source, "--seeds", str(args.seeds)]
    if args.overrides:
        argv += ["--set", *args.overrides]
    if args.out:
        argv += ["--out", args.out]
    if args.code:
        argv += ["--code", args.code]
    return argv + (["--no-progress"] if args.no_progress else [])


def add_parser(sub: Any, spec_args: Any, func: Any) -> None:
    p = sub.add_parser("compare", help="with vs without teleport over seeds, as a sweep on the service: "
                                       "`tlab compare SPEC --seeds 3` (`--local`: in this process)",
                       description=__doc__.split("\n\n")[0] + " " + __doc__.split("\n\n")[1].replace("\n", " "))
    spec_args(p)
    p.add_argument("--seeds", type=int, default=3, help="seeds per variant (default 3)")
    p.add_argument("--max-concurrent", type=int, default=2, help="trials at once (each is one DDP run)")
    p.add_argument("--out", help="output directory (default runs/compare-<time>)")
    p.add_argument("--name", help="the sweep's name")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the study as JSON instead of the table")
    p.add_argument("--local", action="store_true", help="run every seed in this process instead (no service)")
    p.add_argument("--code", metavar="DIR", default=None,
                   help="your package's directory (as for `tlab submit --code`): uploaded once and set as the "
                        "sweep's code.package; with --local, put on sys.path")
    p.set_defaults(func=func)
