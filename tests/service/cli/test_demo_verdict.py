"""tlab demo's verdict: both ratios, seconds first (the one that counts), and a loss on the clock said first."""

from __future__ import annotations

from service.cli.demo import SHORT_RUN_S, noise_note, verdict

TELE = {"epochs_to_target": 8, "seconds_to_target": 1.1, "teleport_share": 0.59}
BASE = {"epochs_to_target": 16, "seconds_to_target": 0.5, "teleport_share": 0.0}


def test_a_run_that_loses_on_the_clock_says_so_first() -> None:
    assert verdict(TELE, BASE) == ("teleport lost on wall-clock: 2.20x more seconds to the target, though 2.00x "
                                   "fewer epochs (teleport took 59 % of its run)")


def test_a_run_that_wins_names_seconds_then_epochs() -> None:
    fast = {**TELE, "seconds_to_target": 0.4, "teleport_share": 0.08}
    assert verdict(fast, BASE) == ("teleport reached the target in 1.25x fewer seconds and 2.00x fewer epochs "
                                   "(teleport took 8 % of its run)")
    slower_epochs = {**fast, "epochs_to_target": 20}
    assert verdict(slower_epochs, BASE).endswith("1.25x fewer seconds and 1.25x more epochs (teleport took 8 % of "
                                                 "its run)")


def test_a_run_that_missed_the_target_is_named() -> None:
    missed = {**TELE, "epochs_to_target": None, "seconds_to_target": None}
    assert verdict(missed, BASE) == ("teleport did not reach the target; without teleport: 16 epochs, 0.5 s "
                                     "(teleport took 59 % of its run)")
    assert verdict(TELE, {**BASE, "epochs_to_target": None, "seconds_to_target": None}).startswith(
        "teleport reached the target in 8 epochs, 1.1 s; without teleport it did not")
    ended = {"epochs": 6, "final_train_loss": 0.1427, "seconds": 0.5}
    assert verdict({**missed, **ended}, {**ended, "final_train_loss": 0.1533, "seconds": 0.6}) == (
        "neither run reached the target; after 6 epochs train loss 0.1427 with teleport vs 0.1533, in 0.5 vs 0.6 "
        "seconds (teleport took 59 % of its run)")


def test_runs_too_short_to_time_say_the_epochs_are_the_steady_ratio() -> None:
    assert noise_note(TELE, BASE).startswith("(both runs reached the target in under 5 s: between demos")
    slow = {**BASE, "seconds_to_target": SHORT_RUN_S}
    assert noise_note(TELE, slow) is None  # one run long enough to time: the verdict stands alone
    assert noise_note(TELE, {**BASE, "seconds_to_target": None}) is None  # nothing to compare
