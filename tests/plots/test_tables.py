"""The compare table says which runs' teleports stopped early because one made no move."""

from __future__ import annotations

from plots.tables import compare_table

SAID = "teleport made no move at epoch 0 (‖∇L‖² 11.2 ≥ cap 5): the next teleports skipped"


def test_the_table_names_the_runs_whose_teleports_stopped() -> None:
    run = {"final_train_loss": 1.0, "final_test_loss": 1.1, "seconds": 3.0, "teleport_share": 0.01}
    groups = {"baseline": [run, run], "nullspace": [run | {"teleport_skipped": SAID}, run]}
    lines = compare_table(groups, 2, None).splitlines()
    assert lines[-1] == f"nullspace: {SAID} (1/2 seeds)"
    assert not any(line.startswith("baseline:") for line in lines)
    assert len(compare_table({"baseline": [run]}, 1, None).splitlines()) == 3  # header, rule, one row
