"""``tlab run``'s one-line summary names the time to the target loss in epochs and in wall-clock seconds."""

from __future__ import annotations

from workers.cli import _describe
from workers.train.shared import summarize


def history() -> list[dict[str, float]]:
    return [{"epoch": e, "train_loss": 1.0 / (e + 1), "test_loss": 1.2 / (e + 1), "seconds": 1.5 * (e + 1) + 0.25,
             "teleport_seconds": 0.25} for e in range(4)]


def test_the_summary_line_gives_epochs_and_seconds_to_target() -> None:
    summary = summarize(history(), target_loss=0.4, teleport_batches=1)
    assert (summary["epochs_to_target"], summary["seconds_to_target"]) == (3, 4.75)  # 1/3 < 0.4 after epoch 2
    line = _describe(summary)
    assert "target 0.4 reached after 3 epochs, 4.8 s" in line, line
    missed = _describe(summarize(history(), target_loss=0.1, teleport_batches=1))
    assert "target 0.1 not reached" in missed and "epochs," not in missed, missed
