"""``python -m workers.cli`` (``tlab run|compare|presets|validate``): run specs in this process.

    tlab run SPEC --local|--ray [--out DIR] [--set path=value ...] [--no-progress] [--code DIR]
    tlab compare SPEC [--seeds N] [--out DIR] [--set path=value ...]
    tlab presets
    tlab validate SPEC [--set path=value ...]

SPEC is a preset name (``tlab presets``) or a YAML/JSON file. Exit status: 0 done, 1 training
diverged, 2 unusable spec or missing data (the message says what to change).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from api_schemas import ExperimentSpec, SpecError, load_spec
from plots.tables import compare_table, group_stats

RUNS_DIR = Path("runs")


# ----------------------------------------------------------------------------- helpers


def _slug(source: str) -> str:
    """A preset name or a spec file -> a directory-friendly name."""
    name = Path(source).stem if Path(source).suffix in {".yaml", ".yml", ".json"} else source
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"


def _default_out(source: str, what: str = "") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return RUNS_DIR / f"{_slug(source)}{what}-{stamp}"


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _describe(summary: dict[str, Any]) -> str:
    parts = [f"train loss {_fmt(summary['final_train_loss'])}",
             f"test loss {_fmt(summary['final_test_loss'])}"]
    if summary.get("final_test_acc") is not None:
        parts.append(f"test acc {summary['final_test_acc']:.2%}")
    if summary.get("final_test_ppl") is not None:
        parts.append(f"test ppl {_fmt(summary['final_test_ppl'])}")
    if summary.get("target_loss") is not None:
        hit, secs = summary.get("epochs_to_target"), summary.get("seconds_to_target")
        reached = f"reached after {hit} epochs, {secs:.1f} s" if hit else "not reached"
        parts.append(f"target {summary['target_loss']:g} {reached}")
    parts.append(f"{summary['seconds']:.1f} s (teleport {summary['teleport_share']:.0%})")
    return " · ".join(parts)


# ---------------------------------------------------------------------------- commands


def cmd_run(args: argparse.Namespace) -> int:
    """Train one spec in this process (--local) or as Ray Train DDP workers (--ray); outputs in --out."""
    if not (args.local or args.ray):
        print("error: say where to run: --local trains in this process, --ray on a Ray cluster "
              "(RAY_ADDRESS, or a local one started for the run)", file=sys.stderr)
        return 2
    code = None
    if args.code:
        from workers.train.user_code import add_code_dir

        code = add_code_dir(args.code)  # the factories' modules import from DIR, as from the package on the cluster
    spec = load_spec(args.spec, args.overrides)
    out = Path(args.out) if args.out else _default_out(args.spec)
    print(f"run {args.spec} -> {out}" + (f" on Ray ({spec.resources.workers} workers)" if args.ray else ""),
          file=sys.stderr)
    if args.ray:
        from workers.on_ray.ray_train import run_on_ray

        summary = run_on_ray(spec, out, code=code)  # DIR goes to every worker as Ray's working_dir
    else:
        from workers.train.loop import run_local
        from workers.train.sinks import SaySink

        say = SaySink() if args.no_progress else None  # (with progress, run_local says them itself)
        summary = run_local(spec, out, progress=not args.no_progress, sink=say, threads=args.threads)
    print(_describe(summary))
    print(f"wrote {out / 'metrics.jsonl'}, {out / 'summary.json'}, {out / 'curves.png'}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """The spec with and without teleport over N seeds: table, DIR/compare.png (bands), DIR/compare.json."""
    if args.seeds < 1:
        print("error: --seeds must be at least 1", file=sys.stderr)
        return 2
    if args.code:
        from workers.train.user_code import add_code_dir

        add_code_dir(args.code)  # the factories' modules import from DIR, as in `tlab run --local --code DIR`
    # both variants validated before anything runs
    variants = {on: load_spec(args.spec, [*args.overrides, f"teleport.enabled={str(on).lower()}"])
                for on in (True, False)}
    from plots.curves import plot_bands
    from workers.train.loop import run_label, run_local
    from workers.train.shared import TrainingDiverged
    from workers.train.sinks import MemorySink, SaySink, TeeSink

    out = Path(args.out) if args.out else _default_out(args.spec, "-compare")
    labels = {enabled: run_label(spec) for enabled, spec in variants.items()}
    summaries: dict[str, list[dict[str, Any]]] = {labels[True]: [], labels[False]: []}
    records: dict[str, list[list[dict[str, Any]]]] = {labels[True]: [], labels[False]: []}
    total, k = 2 * args.seeds, 0
    for seed in range(args.seeds):
        for enabled in (True, False):
            k += 1
            label = labels[enabled]
            spec = load_spec(args.spec, [*args.overrides, f"teleport.enabled={str(enabled).lower()}",
                                         f"training.seed={seed}"])
            run_dir = out / _slug(label) / f"seed{seed}"
            print(f"[{k}/{total}] {label}, seed {seed} -> {run_dir}", file=sys.stderr)
            memory = MemorySink()
            try:
                sink = TeeSink(memory, SaySink()) if args.no_progress else memory  # the hints, bar or not
                summary = run_local(spec, run_dir, progress=not args.no_progress, sink=sink, threads=args.threads)
            except TrainingDiverged as err:  # a result too: counted, left out of the means
                print(f"warning: {err}", file=sys.stderr)
                summary = {"seed": seed, "diverged": str(err)}
            summaries[label].append({key: v for key, v in summary.items() if key != "spec"})
            if not summary.get("diverged"):
                records[label].append(memory.records)
    base = variants[True]
    title = f"{base.dataset.name} · {base.model.kind} · {base.optimizer.name}: {args.seeds} seed(s)"
    plot_bands(records, out / "compare.png", title=title)
    table = compare_table(summaries, args.seeds, base.training.target_loss)
    result = {
        "spec": base.model_dump(mode="json"),
        "seeds": args.seeds,
        "groups": {label: {"stats": group_stats(runs), "runs": runs} for label, runs in summaries.items()},
        "table": table,
    }
    (out / "compare.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    print(table)
    print(f"wrote {out / 'compare.png'}, {out / 'compare.json'}")
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    """List the presets with one line each."""
    from api_schemas.presets import PRESET_NOTES, PRESETS

    width = max(len(name) for name in PRESETS)
    for name in sorted(PRESETS):
        print(f"{name.ljust(width)}  {PRESET_NOTES.get(name, '')}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Print the normalized spec (every default filled in) as YAML."""
    spec: ExperimentSpec = load_spec(args.spec, args.overrides)
    print(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False), end="")
    return 0


# ------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tlab", description="Run teleport experiments in this process.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def threads_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--threads", type=int, default=None, metavar="N",
                       help="torch threads (default resources.cpus_per_worker; 0 = torch's default)")

    def spec_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("spec", metavar="SPEC", help="a preset name (`tlab presets`) or a YAML/JSON spec file")
        p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[],
                       metavar="PATH=VALUE", help="override fields: --set training.epochs=5 teleport.tau=0.9")

    p = sub.add_parser("run", help="train one spec (--local: in this process)", description=cmd_run.__doc__)
    spec_args(p)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="train in this process")
    where.add_argument("--ray", action="store_true", help="train with Ray Train on RAY_ADDRESS (or a local cluster)")
    p.add_argument("--out", help="output directory (default runs/<spec>-<time>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--code", metavar="DIR", default=None,
                   help="your package's directory: put on sys.path (--ray: sent to every worker as Ray's "
                        "runtime_env working_dir), so model/dataset factories, a loss function and an own loop "
                        "(pkg.module:function) import from it")
    threads_arg(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("compare", help="with vs without teleport over N seeds",
                       description=cmd_compare.__doc__)
    spec_args(p)
    p.add_argument("--seeds", type=int, default=3, help="seeds per variant (training.seed = 0..N-1)")
    p.add_argument("--out", help="output directory (default runs/<spec>-compare-<time>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--code", metavar="DIR", default=None,
                   help="your package's directory, put on sys.path: factories (pkg.module:function) import from it")
    threads_arg(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("presets", help="list the presets", description=cmd_presets.__doc__)
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("validate", help="print the normalized spec, or what is wrong with it",
                       description=cmd_validate.__doc__)
    spec_args(p)
    p.set_defaults(func=cmd_validate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = bool(os.environ.get("TLAB_DEBUG"))
    try:
        return int(args.func(args))
    except SpecError as err:  # one line per field
        for line in str(err).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:  # DatasetNotFound: the message names the files and the field to set
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # a valid spec that does not fit the data (model.kind vs input shape, ...)
        if debug:
            raise
        print(f"error: {err} (TLAB_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2
    except RuntimeError as err:
        from workers.train.shared import TrainingDiverged

        if debug or not isinstance(err, TrainingDiverged):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the metrics written so far are in the run's metrics.jsonl", file=sys.stderr)
        return 130


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()  # a reader that left (`tlab presets | head -1`) surfaces here
    except BrokenPipeError:  # end quietly, the recipe of Python's signal docs (as service.cli.main does)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    sys.exit(code)
