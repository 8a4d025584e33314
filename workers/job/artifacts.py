"""A job's artifacts: what its owner takes home, under ``<TLAB_STORAGE>/<job>/artifacts/``.

Written by the job's driver once training ends, however it ends (succeeded, failed, or stopped by a cancel or
its time limit: SIGTERM gives it the grace period), from the last checkpoint Ray Train kept:

- ``model.safetensors``: the model's state_dict as safetensors (data, never code; tied weights stored once
  per name, so ``safetensors.torch.load_file`` then ``model.load_state_dict`` gives the model back);
- ``checkpoint.pt``: that checkpoint (``torch.load(..., weights_only=True)``), to go on from;
- ``metrics.csv``: one row per epoch; ``summary.json``: the run's summary (``workers.train.loop.summarize``);
- whatever the training code wrote to ``ctx.artifacts_dir`` (the same directory).

Each file is written to a hidden temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

from api_schemas import ExperimentSpec

ARTIFACTS = "artifacts"
CHECKPOINT_FILE = "checkpoint.pt"  # workers.train.context writes it; torch is imported only when exporting


def artifacts_dir(storage: str | Path, run_name: str) -> Path:
    """``<storage>/<run>/artifacts``: inside the run's own Ray Train directory."""
    return Path(storage) / run_name / ARTIFACTS


def checkpoints(run_dirs: list[Path]) -> list[Path]:
    """The runs' Ray Train checkpoint directories, newest first (their names carry the time)."""
    found = [p for d in run_dirs for p in d.glob("checkpoint_*") if (p / CHECKPOINT_FILE).is_file()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def last_training_state(run_dirs: list[Path]) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that holds a model (a diverged run's last one holds only its failure)."""
    from workers.train.context import read_checkpoint

    for path in checkpoints(run_dirs):
        state = read_checkpoint(path)
        if "model" in state:
            return path, state
    return None


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save_weights(state_dict: dict[str, Any], path: Path) -> None:
    """The state_dict as safetensors; each tensor cloned, since safetensors refuses tensors sharing memory
    (tied weights) and a checkpoint loaded back keeps the sharing."""
    from safetensors.torch import save_file
    from torch import Tensor

    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items() if isinstance(v, Tensor)}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def metrics_csv(history: list[dict[str, Any]]) -> str:
    """One row per epoch record; columns in the order they first appear."""
    columns = list(dict.fromkeys(k for row in history for k in row if k != "kind"))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(history)
    return out.getvalue()


def export(spec: ExperimentSpec, run_dirs: list[Path], out: Path, extra: dict[str, Any] | None = None) -> list[str]:
    """Write the artifacts of the run whose checkpoints are in ``run_dirs`` (a PBT trial trains in several) to
    ``out``; returns the names written ([] with no checkpoint yet). ``extra`` goes into summary.json."""
    from workers.train.shared import summarize

    found = last_training_state(run_dirs)
    if found is None:
        return []
    path, state = found
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{CHECKPOINT_FILE}.tmp"
    shutil.copyfile(path / CHECKPOINT_FILE, tmp)
    os.replace(tmp, out / CHECKPOINT_FILE)
    save_weights(state["model"], out / "model.safetensors")
    history = list(state.get("history", []))
    _write(out / "metrics.csv", metrics_csv(history).encode())
    summary = summarize(history, spec.training.target_loss, int(state.get("teleport_batches", 0)))
    summary.update(complete=len(history) >= spec.training.epochs, epochs_planned=spec.training.epochs,
                   **(extra or {}))
    _write(out / "summary.json", (json.dumps(summary, indent=2, default=float) + "\n").encode())
    return [CHECKPOINT_FILE, "model.safetensors", "metrics.csv", "summary.json"]
