"""A failed trial's row says why in one line, read from the error text Tune keeps for the trial."""

from __future__ import annotations

import traceback

from workers.sweep import TrialFailed, trial_reason


class KeptError:
    """What ``trial_reason`` reads of a Tune trial: ``get_error()``, the text Tune wrote for its last error."""

    def __init__(self, text: str | None) -> None:
        self.text = text

    def get_error(self) -> str | None:
        if self.text == "gone":
            raise FileNotFoundError("the trial's directory")
        return self.text


def raised_text(err: BaseException) -> str:
    try:
        raise err
    except BaseException as caught:  # noqa: BLE001
        return "".join(traceback.format_exception(caught))


def test_the_reason_a_trial_gave_is_the_rows_reason() -> None:
    text = "Failure # 1 (occurred at 2026-11-25)\n" + raised_text(TrialFailed("epoch 3: loss is NaN"))
    assert trial_reason(KeptError(text)) == "epoch 3: loss is NaN"


def test_any_other_error_gives_its_last_line_and_a_missing_one_still_says_failed() -> None:
    assert trial_reason(KeptError(raised_text(ValueError("bad value")))) == "ValueError: bad value"
    assert trial_reason(KeptError(None)) == "the trial failed (no error was kept)"
    assert trial_reason(KeptError("gone")) == "the trial failed (no error was kept)"
    assert len(trial_reason(KeptError("x" * 5000))) == 300
