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


class Trial:
    """What TrialTable reads of a Tune trial: its id, config and last result."""

    def __init__(self, trial_id: str, config: dict, last_result: dict | None = None) -> None:
        self.trial_id, self.config, self.last_result = trial_id, config, last_result or {}


def test_the_rows_the_driver_writes_are_rows_the_api_reads(redis_server: str) -> None:
    from service.api.studies import trial_rows
    from service.core.store import Store
    from workers.sweep import TrialTable

    table = TrialTable(redis_server, "s9", "train_loss", "min", epochs=5)
    ok, bad = Trial("t0", {"teleport.lr": 0.1}), Trial("t1", {"teleport.lr": 0.2})
    table.update(ok, state="running")
    table.update(ok, result={"train_loss": 0.5, "epochs": 5, "final_train_loss": 0.5, "gpu_memory_peak_mb": 96.5,
                             "device": "cuda:0"})
    table.update(ok, state="done")
    table.update(bad, result={"train_loss": 0.9, "epochs": 3})
    table.update(bad, state="failed", reason="epoch 3: loss is NaN")
    rows = {r.trial: r for r in trial_rows(Store.from_url(redis_server), "s9")}
    assert rows["t0"].state == "succeeded" and rows["t0"].best == 0.5 and rows["t0"].reason is None
    assert rows["t0"].summary == {"epochs": 5, "final_train_loss": 0.5, "gpu_memory_peak_mb": 96.5}  # a trial on a GPU
    assert rows["t1"].state == "failed" and rows["t1"].reason == "epoch 3: loss is NaN" and rows["t1"].epochs == 3


def test_a_trial_stopped_at_its_time_limit_says_so(redis_server: str) -> None:
    from service.api.studies import trial_rows
    from service.core.store import Store
    from workers.sweep import TrialTable

    table = TrialTable(redis_server, "s10", "train_loss", "min", epochs=1000, time_limit_s=3)
    timed, asha = Trial("t0", {}, {"time_total_s": 3.02}), Trial("t1", {}, {"time_total_s": 1.1})
    for trial, epochs in ((timed, 14), (asha, 2)):
        table.update(trial, result={"train_loss": 0.5, "epochs": epochs})
        table.update(trial, state="done")
    rows = {r.trial: r for r in trial_rows(Store.from_url(redis_server), "s10")}
    assert rows["t0"].state == "stopped early" and rows["t0"].reason == "time limit of 3 s reached at epoch 14"
    assert rows["t1"].state == "stopped early" and rows["t1"].reason is None  # the search's scheduler stopped it
