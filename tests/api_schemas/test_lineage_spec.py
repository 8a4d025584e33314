"""The child's spec derived from its parent's (continue, fork), and what may not change across a checkpoint: no
Redis, no Ray."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from api_schemas import ExperimentSpec
from api_schemas.lineage import (
    FIXED,
    ContinueRequest,
    ForkRequest,
    LineageError,
    StartFrom,
    continue_spec,
    fixed_field,
    fork_spec,
    lineage_view,
)

PARENT = ExperimentSpec.model_validate({
    "model": {"kind": "mlp", "hidden": [32]}, "dataset": {"name": "digits"},
    "training": {"epochs": 3, "batch_size": 64}, "teleport": {"epochs": [0, 2], "tau": 1.0}})


def test_continue_trains_n_more_than_the_final_checkpoint() -> None:
    child = continue_spec(PARENT, 3, 2)
    assert child.training.epochs == 5
    assert child.model_dump(exclude={"training"}) == PARENT.model_dump(exclude={"training"})
    # a cancelled parent's final checkpoint is earlier than its planned epochs: N more than that one
    assert continue_spec(PARENT, 1, 2).training.epochs == 3


def test_fork_changes_only_what_it_sets() -> None:
    child = fork_spec(PARENT, 2, {"teleport.tau": 0.99, "optimizer.lr": 0.05, "training.epochs": 6})
    assert (child.teleport.tau, child.optimizer.lr, child.training.epochs) == (0.99, 0.05, 6)
    assert child.model == PARENT.model and child.dataset == PARENT.dataset
    assert fork_spec(PARENT, 2, {}) == PARENT
    # resources may change: the checkpoint holds the bare model and the optimizer state
    assert fork_spec(PARENT, 2, {"resources.workers": 2}).resources.workers == 2


@pytest.mark.parametrize("path", ["model.hidden", "model", "dataset.max_train", "training.dtype", "optimizer.name",
                                  "code.package"])
def test_fields_that_cannot_change_across_a_checkpoint_are_refused_by_name(path: str) -> None:
    with pytest.raises(LineageError) as err:
        fork_spec(PARENT, 2, {path: 1})
    assert err.value.field == f"set.{path}"
    assert "cannot change across a checkpoint" in str(err.value)
    assert fixed_field(path) in FIXED


def test_unknown_fields_bad_values_and_nothing_left_to_train() -> None:
    with pytest.raises(LineageError) as err:
        fork_spec(PARENT, 2, {"teleport.taus": 0.9})
    assert err.value.field == "set.teleport.taus" and "no field teleport.taus" in str(err.value)
    with pytest.raises(LineageError) as err:
        fork_spec(PARENT, 2, {"teleport.tau": 2})
    assert err.value.field == "set.teleport.tau" and "\n" not in str(err.value)
    with pytest.raises(LineageError) as err:
        fork_spec(PARENT, 3, {})
    assert err.value.field == "from_epoch" and "training.epochs=3" in str(err.value)
    assert fixed_field("training.epochs") is None and fixed_field("modelx") is None


def test_requests_and_start_from_are_strict() -> None:
    assert ForkRequest.model_validate({"from_epoch": 2}).set == {}
    for bad in [{"from_epoch": 0}, {"from_epoch": 2, "sett": {}}, {"from_epoch": 2, "set": {"": 1}}]:
        with pytest.raises(ValidationError):
            ForkRequest.model_validate(bad)
    with pytest.raises(ValidationError):
        ContinueRequest.model_validate({"epochs": 0})
    start = StartFrom(job="18f3a2b4c5d-9e1f2a", epoch=2, checkpoint="checkpoint_2026-01-01_00-00-00.000001")
    assert str(start.path("/s")) == "/s/18f3a2b4c5d-9e1f2a/checkpoint_2026-01-01_00-00-00.000001"
    for name in ["../x", "checkpoint_a/../../b", "other"]:  # a name never leads out of the parent's run dir
        with pytest.raises(ValidationError):
            StartFrom(job="18f3a2b4c5d-9e1f2a", epoch=2, checkpoint=name)
    assert lineage_view({}) == {"parent": None, "parent_epoch": None, "children": []}
    assert lineage_view({"parent": "p", "parent_epoch": "3", "children": '["c"]'}) == {
        "parent": "p", "parent_epoch": 3, "children": ["c"]}
