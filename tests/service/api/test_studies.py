"""A sweep's results without Ray: trials table from Redis, best trial, seed groups, the study table, the plot."""

from __future__ import annotations

from typing import Any

import pytest

from api_schemas import keys
from api_schemas.jobs import TrialRow
from api_schemas.sweeps import SweepSubmit
from service.api.studies import best_trial, legend, seed_groups, study_view, sweep_png, trial_rows
from service.core.store import Store
from tests.service.conftest import tiny

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sweep(space: dict[str, dict[str, Any]], mode: str = "min") -> SweepSubmit:
    return SweepSubmit.model_validate({"base": tiny(training={"target_loss": 0.5}), "search_space": space,
                                       "mode": mode})


def row(trial: str, lr: float, seed: int | None = None, best: float | None = None, **summary: float) -> TrialRow:
    config: dict[str, Any] = {"teleport.lr": lr} | ({} if seed is None else {"training.seed": seed})
    return TrialRow(trial=trial, config=config, state="TERMINATED", epochs=2, best=best, summary=summary)


SEEDED = sweep({"teleport.lr": {"choice": [0.1, 0.2]}, "training.seed": {"grid": [0, 1]}})
ROWS = [row("t0", 0.1, 0, 0.40, final_train_loss=0.40), row("t1", 0.1, 1, 0.60, final_train_loss=0.60),
        row("t2", 0.2, 0, 0.30, final_train_loss=0.30), row("t3", 0.2, 1, None)]


def test_best_trial_follows_the_mode_and_skips_unscored_trials() -> None:
    assert best_trial(ROWS, "min").trial == "t2"  # type: ignore[union-attr]
    assert best_trial(ROWS, "max").trial == "t1"  # type: ignore[union-attr]
    assert best_trial([row("a", 0.1), row("b", 0.2)], "min") is None
    assert best_trial([], "max") is None


def test_seed_groups_pool_trials_that_differ_only_in_the_seed() -> None:
    groups = seed_groups(SEEDED, ROWS)
    assert {k: [t.trial for t in v] for k, v in groups.items()} == {"teleport.lr=0.1": ["t0", "t1"],
                                                                    "teleport.lr=0.2": ["t2", "t3"]}
    unseeded = sweep({"teleport.lr": {"choice": [0.1, 0.2]}})
    assert list(seed_groups(unseeded, ROWS)) == ["t0", "t1", "t2", "t3"]  # no seed axis: each trial alone
    only_seed = sweep({"training.seed": {"grid": [0, 1]}})
    assert list(seed_groups(only_seed, [row("a", 0.1, 0), row("b", 0.1, 1)])) == ["teleport.lr=0.1"]
    assert list(seed_groups(only_seed, [TrialRow(trial="a", config={"training.seed": 0}, state="x", epochs=0)])) \
        == ["all"]


def test_study_view_gives_mean_and_std_over_seeds_per_group() -> None:
    study = study_view("s1", SEEDED, ROWS)
    assert study.seeds == 2 and study.target_loss == 0.5
    first = study.groups[0]
    assert first.config == {"teleport.lr": 0.1} and first.trials == ["t0", "t1"]
    assert first.stats["final_train_loss"]["mean"] == pytest.approx(0.5)
    assert first.stats["final_train_loss"]["n"] == 2
    assert study.groups[1].stats["final_train_loss"]["n"] == 1  # t3 has not reported
    assert "teleport.lr=0.1" in study.table and "teleport.lr=0.2" in study.table
    empty = study_view("s2", SEEDED, [])
    assert empty.groups == [] and empty.seeds == 0 and empty.table == "(no trial has reported yet)"


def test_trial_rows_read_the_drivers_table_in_trial_order(redis_server: str) -> None:
    store = Store.from_url(redis_server)
    store.r.hset(keys.trials("s1"), mapping={t.trial: t.model_dump_json() for t in reversed(ROWS)})
    assert [t.trial for t in trial_rows(store, "s1")] == ["t0", "t1", "t2", "t3"]
    assert trial_rows(store, "nope") == []


def epochs(trial: str, losses: list[float]) -> list[dict[str, Any]]:
    return [{"kind": "epoch", "trial": trial, "epoch": i + 1, "train_loss": v, "test_loss": v} for i, v in
            enumerate(losses)]


def test_sweep_png_draws_bands_with_a_seed_axis_and_curves_without() -> None:
    recs = epochs("t0", [1.0, 0.5]) + epochs("t1", [0.9, 0.4]) + [{"kind": "status", "state": "running"}]
    seeded = sweep_png("s1", SEEDED, recs, ROWS)
    plain = sweep_png("s1", sweep({"teleport.lr": {"choice": [0.1, 0.2]}}), recs, ROWS)
    assert seeded.startswith(PNG_MAGIC) and plain.startswith(PNG_MAGIC)
    assert seeded != plain


def test_a_sweeps_plot_names_each_curve_by_its_settings() -> None:
    rows = [TrialRow(trial=f"t{i}", config=config, state="running", epochs=1)
            for i, config in enumerate([{"teleport.lr": 0.1, "optimizer.name": "sgd"}, {"teleport.lr": 0.25},
                                        {"teleport.lr": 0.25}])]
    assert list(legend(rows)) == ["optimizer.name=sgd, teleport.lr=0.1", "teleport.lr=0.25 (t1)",
                                  "teleport.lr=0.25 (t2)"]  # the id only to tell a repeated setting apart
