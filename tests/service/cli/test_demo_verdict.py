"""tlab demo's verdict: seconds first (the one that counts), pooled over the seeds with their range; a loss on the
clock is said first, seeds that disagree decide nothing, a missed target is counted; the steady seconds count the
median epoch and teleport's own seconds."""

from __future__ import annotations

import pytest

from service.cli.demo import SEEDS, STEADY, seconds_ratio, stack_env, steady_seconds, training_seconds, verdict
from service.core.settings import Settings


def seed(et: int, st: float, eb: int, sb: float, share: float = 0.05) -> tuple[dict, dict]:
    return ({"epochs_to_target": et, "seconds_to_target": st, "teleport_share": share, "final_train_loss": 1.9},
            {"epochs_to_target": eb, "seconds_to_target": sb, "teleport_share": 0.0, "final_train_loss": 2.0})


def test_a_win_names_seconds_then_epochs_pooled_with_the_seed_range() -> None:
    pairs = [seed(14, 6.0, 42, 18.0), seed(15, 7.0, 43, 17.0), seed(15, 5.0, 43, 15.0)]
    assert seconds_ratio(pairs) == 18.0 / 50.0
    assert verdict(pairs) == ("teleport won on wall-clock: 2.78x fewer seconds to the target (over 3 seeds: "
                              "0.33-0.41x the baseline's) and 2.91x fewer epochs (0.33-0.35x) (teleport took 5 % of "
                              "its runs)")


def test_a_loss_on_the_clock_is_said_first() -> None:
    assert verdict([seed(8, 1.1, 16, 0.5, share=0.59)]) == (
        "teleport lost on wall-clock: 2.20x more seconds to the target (one seed: 2.20-2.20x the baseline's), though "
        "2.00x fewer epochs (0.50-0.50x) (teleport took 59 % of its runs)")


def test_seeds_that_disagree_decide_nothing() -> None:
    assert verdict([seed(8, 0.9, 16, 1.0), seed(8, 1.2, 16, 1.0)]).startswith(
        "no verdict on wall-clock: 1.05x more seconds to the target (over 2 seeds: 0.90-1.20x the baseline's)")


def test_a_missed_target_is_counted() -> None:
    missed = ({**seed(1, 1, 1, 1)[0], "epochs_to_target": None, "seconds_to_target": None}, seed(1, 1, 16, 5.0)[1])
    assert seconds_ratio([missed]) is None
    assert verdict([missed, seed(8, 1.0, 16, 2.0)]) == (
        "no verdict: teleport reached the target in 1 of 2 seeds, the baseline in 2; final train loss 1.9000 with "
        "teleport vs 2.0000 (teleport took 5 % of its runs)")


@pytest.mark.parametrize("seeds", [1, SEEDS, 12])
def test_the_demos_stack_plots_every_run_of_the_demo_in_one_figure(seeds: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Its runs, two a seed, fit the one plot the API draws for it (TLAB_MAX_COMPARE, 8 by default)."""
    for name, value in stack_env(seeds).items():
        monkeypatch.setenv(name, value)
    assert Settings().max_compare >= 2 * seeds


def points(epochs: list[float], teleports: dict[int, float]) -> list[dict]:
    """A run's epoch points as the API gives them: cumulative seconds and teleport seconds."""
    out, clock, tele = [], 0.0, 0.0
    for i, train in enumerate(epochs):
        tele += teleports.get(i, 0.0)
        clock += train + teleports.get(i, 0.0)
        out.append({"epoch": i, "seconds": clock, "teleport_seconds": tele})
    return out


def test_steady_seconds_count_the_median_epoch_and_teleports_own_seconds() -> None:
    """A stretched epoch (a busy minute) moves the raw clock, not the steady count; teleport's seconds count in
    full; a run that missed the target gets none."""
    with_t = {"epochs_to_target": 3, "seconds_to_target": 0.0}
    without = {"epochs_to_target": 5, "seconds_to_target": 0.0}
    missed = {"epochs_to_target": None, "seconds_to_target": None}
    runs = [(with_t, points([0.3, 0.3, 0.3, 0.3], {0: 0.5, 1: 0.25})),
            (without, points([0.3, 3.0, 0.3, 0.3, 0.3, 0.3], {})),
            (missed, points([9.0, 9.0], {}))]
    assert steady_seconds(runs) == pytest.approx(0.3)
    assert with_t[STEADY] == pytest.approx(3 * 0.3 + 0.75) and without[STEADY] == pytest.approx(5 * 0.3)
    assert STEADY not in missed
    assert training_seconds(runs[0][1]) == pytest.approx([0.3, 0.3, 0.3, 0.3])


def test_the_steady_verdict_says_how_it_counted_and_what_the_clock_said() -> None:
    pairs = [seed(14, 6.0, 42, 18.0), seed(15, 7.0, 43, 17.0)]
    for (t, b), (st, sb) in zip(pairs, [(4.5, 12.6), (4.8, 12.9)], strict=True):
        t[STEADY], b[STEADY] = st, sb
    assert seconds_ratio(pairs) == pytest.approx(9.3 / 25.5)
    assert seconds_ratio(pairs, "seconds_to_target") == pytest.approx(13.0 / 35.0)
    said = verdict(pairs, 0.3)
    assert said.startswith("teleport won on wall-clock: 2.74x fewer seconds to the target (over 2 seeds: "
                           "0.36-0.37x the baseline's)"), said
    assert said.endswith("seconds counted as epochs x the median epoch, 0.300 s, + teleport's own seconds; the raw "
                         "clock said 0.37x, 0.33-0.41x)"), said
    assert verdict(pairs).startswith("teleport won on wall-clock: 2.69x fewer seconds")  # no median: the raw clock
    assert "raw clock" not in verdict(pairs)
