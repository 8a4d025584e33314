"""The payoff part of ``benchmarks.lm_payoff``: the char LM of ``examples/tiny_lm`` trained with and without teleport
through the product's own loop, seconds to the baseline's final train loss as a ratio, per row of ``ROWS``."""

from __future__ import annotations

import math
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from api_schemas.spec import SCALE_FREE

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_lm"

RECIPE = {"optimizer": {"weight_decay": 0.1, "schedule": "cosine", "lr_warmup_steps": 20, "final_lr_ratio": 0.1},
          "training": {"grad_clip_norm": 1.0}}
LM_TELEPORT = {"lr": 2.0, "cap": 1e4}  # where the default η 0.2 raises a char LM's ‖∇L‖² by ~1 %


@dataclass(frozen=True)
class Row:
    """A payoff row: its optimizer; ``first_only``: teleport before epoch 0 only (what a run with Adam is told to do:
    ``workers.train.teleporting``), else before epochs 0-4 (the paper's schedule); ``recipe``: the way LMs are trained
    (``RECIPE``: AdamW's weight decay, a warm-up, a cosine decay, a clip); ``teleport``: teleport fields set."""

    optimizer: str
    first_only: bool = False
    recipe: bool = False
    teleport: dict[str, Any] = field(default_factory=dict)

    @property
    def baseline(self) -> tuple[str, bool]:
        """What its baseline run depends on: rows that agree on it share one."""
        return self.optimizer, self.recipe


ROWS = {"sgd": Row("sgd"), "adam": Row("adam"), "adam_first": Row("adam", first_only=True),
        "adamw_recipe": Row("adamw", first_only=True, recipe=True), "adam_lr2": Row("adam", teleport=LM_TELEPORT),
        "adamw_recipe_lr2": Row("adamw", first_only=True, recipe=True, teleport=LM_TELEPORT),
        "adam_scale_free": Row("adam", teleport=SCALE_FREE), "sgd_scale_free": Row("sgd", teleport=SCALE_FREE),
        "adamw_recipe_scale_free": Row("adamw", recipe=True, teleport=SCALE_FREE)}


def lm_spec(row_name: str, teleport: bool, size: str, quick: bool, ascent: str = "auto", seed: int = 0,
            hvp: str = "exact") -> Any:
    """The char LM's spec for a payoff row (``ROWS``), with teleport on or off."""
    row = ROWS[row_name]
    recipe = RECIPE if row.recipe else {}
    from api_schemas.spec_io import build_spec

    gpu = size == "gpu"
    # d > the teleport batch's 2·ctx token columns, so every layer has a null space to move in
    small = (16, 1, 8, 16, 3) if quick else (128, 2, 32, 32, 6)
    d, layers, ctx, batch, epochs = (256, 4, 64, 64, 12) if gpu else small
    chars = None if gpu else (3000 if quick else 20000)
    return build_spec({
        "model": {"kind": "custom", "factory": "tiny_lm.model:gpt",
                  "args": {"d": d, "heads": 4 if d % 4 == 0 else 2, "layers": layers, "max_len": ctx}},
        "dataset": {"name": "custom", "factory": "tiny_lm.data:python_source",
                    "args": {"module": "json.decoder", "seq_len": ctx, "stride": ctx // 2,
                             **({"max_chars": chars} if chars else {})}},
        "training": {"epochs": epochs, "batch_size": batch, "loss": "tiny_lm.loss:next_token", "seed": seed,
                     **recipe.get("training", {})},
        "optimizer": {"name": row.optimizer, "lr": {"sgd": 0.3, "adam": 0.003, "adamw": 0.003}[row.optimizer],
                      **recipe.get("optimizer", {})},
        "teleport": {"enabled": teleport, "epochs": [0] if row.first_only else list(range(min(5, epochs))),
                     "batches": 8 if gpu else 2, "steps": 8, "batch_size": 2, "ascent": ascent, "hvp": hvp,
                     **row.teleport},
    })


def payoff(device: torch.device, size: str, quick: bool, ascent: str = "auto", seeds: int = 1,
           hvp: str = "exact") -> dict[str, Any]:
    """Per optimizer: each seed's baseline and teleport run (seconds to the baseline's final train loss as a ratio,
    teleport's share), and over the seeds the median ratio ("never" counts as infinite) and how many reached it.
    The final losses differ in the third decimal at these sizes, so one seed's ratio is mostly noise."""
    out: dict[str, Any] = {}
    baselines: dict[tuple[tuple[str, bool], int], Any] = {}  # (Row.baseline, seed) -> its baseline run
    for opt in ROWS:
        runs = [_payoff_seed(device, size, quick, (ascent, hvp), opt, seed, baselines) for seed in range(seeds)]
        median = statistics.median(math.inf if r["seconds_ratio"] is None else r["seconds_ratio"] for r in runs)
        out[opt] = runs[0] | {  # seed 0's figures stay at the top (the earlier, single-seed layout)
            "seeds": runs, "median_seconds_ratio": median if math.isfinite(median) else None,
            "reached": sum(r["seconds_ratio"] is not None for r in runs),
            "median_teleport_share": statistics.median(r["teleport_share"] for r in runs),
        }
    return out


def _payoff_seed(device: torch.device, size: str, quick: bool, how: tuple[str, str], opt: str,
                 seed: int, baselines: dict[tuple[tuple[str, bool], int], Any]) -> dict[str, Any]:
    """One seed: the baseline and the teleport run through the product's loop (``how``: teleport.ascent, .hvp); a
    baseline already in ``baselines`` (the same ``Row.baseline`` and seed) is not run again."""
    from workers.train.context import RunContext
    from workers.train.loop import train
    from workers.train.sinks import MemorySink

    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    runs = {}
    for label, tele in (("baseline", False), ("teleport", True)):
        if not tele and (ROWS[opt].baseline, seed) in baselines:
            runs[label] = baselines[(ROWS[opt].baseline, seed)]
            continue
        spec = lm_spec(opt, tele, size, quick, how[0], seed, how[1])
        spec = spec.model_copy(update={"training": spec.training.model_copy(update={"device": device.type})})
        sink = MemorySink()
        summary = train(spec, RunContext(device=device, sink=sink))
        runs[label] = (summary, [r for r in sink.records if r["kind"] == "epoch"],
                       [r for r in sink.records if r["kind"] == "teleport"])
    baselines[(ROWS[opt].baseline, seed)] = runs["baseline"]
    target = runs["baseline"][0]["final_train_loss"]
    hit = next((e for e in runs["teleport"][1] if e["train_loss"] <= target), None)
    return {
        "seed": seed, "baseline_final_train_loss": target, "baseline_seconds": runs["baseline"][0]["seconds"],
        "teleport_final_train_loss": runs["teleport"][0]["final_train_loss"],
        "teleport_seconds_to_target": hit["seconds"] if hit else None,
        "seconds_ratio": hit["seconds"] / runs["baseline"][0]["seconds"] if hit else None,
        "teleport_share": runs["teleport"][0]["teleport_share"],
        "teleport_cuts": runs["teleport"][0]["teleport_cuts"],
        # how its teleport batches ran (``TeleportReport.ascent``), and how many a graph from an earlier one served
        "ascents": dict(Counter(r["ascent"] for r in runs["teleport"][2])),
        "graph_replays": sum(bool(r["graph_replayed"]) for r in runs["teleport"][2]),
    }
