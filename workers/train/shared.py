"""What both training loops share (ours, ``workers.train.loop``, and the user's own, ``workers.train.own_loop``):
a divergence said in one line, the run's summary, the model's size."""

from __future__ import annotations

from typing import Any

from torch import nn

from workers.train.context import RunContext


class TrainingDiverged(RuntimeError):
    """A loss became NaN or infinite; the message names the epoch and what to lower."""


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def summarize(history: list[dict[str, Any]], target_loss: float | None,
              teleport_batches: int) -> dict[str, Any]:
    """Final and best losses, time, teleport's share of it, and epochs/seconds to ``target_loss``."""
    last = history[-1] if history else {}
    seconds = float(last.get("seconds", 0.0))
    tele = float(last.get("teleport_seconds", 0.0))
    out: dict[str, Any] = {
        "epochs": len(history),
        "final_train_loss": last.get("train_loss"),
        "final_test_loss": last.get("test_loss"),
        "best_test_loss": min((h["test_loss"] for h in history), default=None),
        "seconds": seconds,
        "teleport_seconds": tele,
        "teleport_share": tele / seconds if seconds > 0 else 0.0,
        "teleport_batches": teleport_batches,
        "target_loss": target_loss,
        "epochs_to_target": None,
        "seconds_to_target": None,
    }
    if "test_acc" in last:
        out["final_test_acc"] = last["test_acc"]
        out["best_test_acc"] = max(h["test_acc"] for h in history)
    if "test_ppl" in last:
        out["final_test_ppl"] = last["test_ppl"]
        out["best_test_ppl"] = min(h["test_ppl"] for h in history)
    if target_loss is not None:
        hit = next((h for h in history if h["train_loss"] < target_loss), None)
        if hit is not None:
            out["epochs_to_target"] = hit["epoch"] + 1
            out["seconds_to_target"] = hit["seconds"]
    return out


def diverged(ctx: RunContext, where: str, epoch: int, what: str, hint: str) -> TrainingDiverged:
    message = f"training diverged at epoch {epoch} ({where}): {what}; {hint}"
    ctx.sink.emit({"kind": "error", "epoch": epoch, "where": where, "message": message})
    return TrainingDiverged(message)
