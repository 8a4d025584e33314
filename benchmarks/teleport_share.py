"""Teleport's share of a run's wall clock, where it can move and where it cannot, side by side in one process.

- ``default budget``: ``digits/teleport`` (MLP [256, 256], SGD) with teleports before every epoch at the default budget
  (10 %), long enough to last ≥ 30 s here: the share must stay ≤ 1.2 × the budget while the budget calibrates.
- ``cannot move``: the same run with CAP far below every batch's ‖∇L‖²: the first teleport batch takes no step, the
  runner skips the rest (``workers.train.teleporting``): the share after the first must be ≤ 1 %.

    .venv/bin/python -m benchmarks.teleport_share            # writes benchmarks/results/teleport_share.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from api_schemas import build_spec
from api_schemas.presets import PRESETS
from workers.train.loop import run_local

RESULTS = Path(__file__).parent / "results" / "teleport_share.json"


def spec(epochs: int, **teleport: Any) -> Any:
    data = json.loads(json.dumps(PRESETS["digits/teleport"]))
    data["training"].update(epochs=epochs, device="cpu")
    data["teleport"].update(epochs=list(range(epochs)), **teleport)
    return build_spec(data)


def run(epochs: int, **teleport: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        summary = run_local(spec(epochs, **teleport), out, progress=False, threads=1)
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    first = next((r["seconds"] for r in records if r["kind"] == "teleport"), 0.0)
    return {"seconds": summary["seconds"], "wall": time.perf_counter() - started,
            "teleport_seconds": summary["teleport_seconds"], "teleport_share": summary["teleport_share"],
            "after_first_share": (summary["teleport_seconds"] - first) / summary["seconds"],
            "teleport_batches": summary["teleport_batches"], "cuts": summary.get("teleport_cuts"),
            "skipped": summary.get("teleport_skipped")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40, help="epochs of each run (40: ≥ 30 s on a 2-core machine)")
    args = parser.parse_args()
    budget = PRESETS["digits/teleport"]["teleport"].get("budget", 0.1) or 0.1
    rows = {"default budget": run(args.epochs), "cannot move": run(args.epochs, cap=1e-6)}
    result = {"epochs": args.epochs, "budget": budget, "runs": rows,
              "floors": {"share_le_1.2x_budget": rows["default budget"]["teleport_share"] <= 1.2 * budget,
                         "cannot_move_after_first_le_1pct": rows["cannot move"]["after_first_share"] <= 0.01}}
    print(f"{'run':<16}{'seconds':>9}{'teleport s':>12}{'share':>8}{'after first':>13}{'batches':>9}")
    for name, r in rows.items():
        print(f"{name:<16}{r['seconds']:>9.1f}{r['teleport_seconds']:>12.2f}{r['teleport_share']:>8.1%}"
              f"{r['after_first_share']:>13.2%}{r['teleport_batches']:>9}")
    print(f"budget {budget:.0%}; floors: {result['floors']}")
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
