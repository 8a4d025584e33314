"""Every floor the GPU checks measured, in one table at the end of a run: what a session lent a GPU reads first.

``gpu_checks.sh`` leaves a result JSON per benchmark in its folder; each holds its floors, as ``{name: bool}``
(lm_payoff, lm_trained, convergence) or as ``[{floor, value, limit, pass}]`` (step_cost, float32_drift).
``gpu_sharing.json`` (in ``<gpu>/``) holds none: its floors are read off the gang and the sweep.
This prints them all, PASS / FAIL / unmeasured, and writes ``floors.json`` beside them.

    python3 benchmarks/device/floors.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

Row = dict[str, Any]  # {"source", "floor", "pass" (True, False, None: unmeasured), "value"?}


def sharing_floors(result: dict[str, Any]) -> list[Row]:
    """The shared-GPU floors: the 2 x 0.5 GPU gang and the 4-trial 0.25-GPU sweep succeed, every epoch once; the
    sweep's 4 trials at once on the card."""
    gang, sweep = result.get("gang") or {}, result.get("sweep") or {}
    return [
        {"floor": "2 x 0.5 GPU gang succeeded, every epoch once, one card",
         "pass": gang.get("state") == "succeeded" and bool(gang.get("every_epoch_once")) and bool(gang.get("one_card")),
         "value": gang.get("failure") or gang.get("state")},
        {"floor": "4 x 0.25 GPU sweep succeeded, every epoch once",
         "pass": sweep.get("state") == "succeeded" and bool(sweep.get("every_epoch_once")),
         "value": sweep.get("failure") or sweep.get("state")},
        {"floor": "4 trials at once on one card", "pass": sweep.get("most_at_once") == 4,
         "value": sweep.get("most_at_once")},
    ]


def floors_of(result: dict[str, Any]) -> list[Row]:
    if result.get("benchmark") == "gpu_sharing":
        return sharing_floors(result)
    floors = result.get("floors")
    if isinstance(floors, dict):
        return [{"floor": name, "pass": ok} for name, ok in floors.items()]
    if isinstance(floors, list):
        return [{"floor": f["floor"], "pass": f.get("pass"), "value": f.get("value")} for f in floors]
    return []


def collect(folder: Path) -> list[Row]:
    rows: list[Row] = []
    for path in sorted(folder.glob("*.json")) + sorted(folder.glob("*/gpu_sharing.json")):
        if path.name == "floors.json":
            continue
        source = str(path.relative_to(folder))
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            rows.append({"source": source, "floor": f"unreadable: {err}", "pass": False})
            continue
        rows += [{"source": source, **row} for row in floors_of(result)]
    return rows


def word(ok: bool | None) -> str:
    return "unmeasured" if ok is None else "PASS" if ok else "FAIL"


def value_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python3 benchmarks/device/floors.py DIR (the folder gpu_checks.sh wrote its JSONs to)")
        return 2
    folder = Path(args[0])
    rows = collect(folder)
    (folder / "floors.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
    print(f"=== floors ({len(rows)}; PASS {sum(r['pass'] is True for r in rows)}, "
          f"FAIL {sum(r['pass'] is False for r in rows)}, unmeasured {sum(r['pass'] is None for r in rows)})")
    for row in rows:
        value = value_text(row.get("value"))
        print(f"{word(row['pass']):>10}  {row['source']}: {row['floor']}" + (f" ({value})" if value else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
