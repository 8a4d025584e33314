"""Continue and fork (lineage): the request bodies, the child's spec derived from its parent's, where it starts.

A child is a new experiment that starts from one of its parent's checkpoints instead of from scratch: a
*continuation* from the parent's final checkpoint with ``N`` more epochs, or a *fork* from the checkpoint after
epoch ``k`` with some fields changed. Its epoch numbers go on from the checkpoint's (the checkpoint carries the
model, the optimizer state and the history), so the parent's curve and the child's are one curve.

What cannot change across a checkpoint (``FIXED``): the model (its shape is the checkpoint's), the data, the code
package (it builds both), ``training.dtype`` and ``optimizer.name`` (the optimizer state belongs to its class).
Everything else may: teleport settings, optimizer hyperparameters, batch size, seed, epochs, resources (the
checkpoint holds the bare model's weights and the optimizer state, whatever the number of workers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api_schemas.keys import JOB_ID_PATTERN
from api_schemas.spec import ExperimentSpec
from api_schemas.spec_io import format_validation_error
from api_schemas.sweeps import _leaves

FIXED = ("model", "dataset", "code", "training.dtype", "optimizer.name")
MAX_SET = 100  # fields one fork may change
MAX_MORE_EPOCHS = 1_000_000  # a continuation's own bound; the service's TLAB_MAX_EPOCHS bounds the total


class LineageError(ValueError):
    """A child that cannot be made: the message says why and what to do, ``field`` names the request field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


SetPath = Annotated[str, Field(min_length=1, max_length=200)]


class ContinueRequest(_Strict):
    """``POST /v1/experiments/{id}/continue``: train ``epochs`` more from the parent's final checkpoint."""

    epochs: int = Field(..., ge=1, le=MAX_MORE_EPOCHS, description="epochs to train after the parent's last one")


class ForkRequest(_Strict):
    """``POST /v1/experiments/{id}/fork``: a new run from the parent's checkpoint after ``from_epoch``."""

    from_epoch: int = Field(..., ge=1, description="start from the checkpoint taken after this many epochs (one "
                                                   "the parent kept: a 409 lists them)")
    set: dict[SetPath, Any] = Field(
        default_factory=dict, max_length=MAX_SET,
        description="dotted spec path -> new value, e.g. {\"teleport.tau\": 0.99}; model.*, dataset.*, code.*, "
                    "training.dtype and optimizer.name cannot change across a checkpoint")


class StartFrom(_Strict):
    """Where a child starts (the job hash's ``start_from``): a checkpoint directory of its parent's run."""

    job: str = Field(..., pattern=JOB_ID_PATTERN)
    epoch: int = Field(..., ge=1)
    checkpoint: str = Field(..., pattern=r"^checkpoint_[\w.-]+$", description="the directory's name in the "
                                                                              "parent's run directory")

    def path(self, storage: str | Path) -> Path:
        return Path(storage) / self.job / self.checkpoint


def lineage_view(data: dict[str, str]) -> dict[str, Any]:
    """The JobView fields of a job hash: ``parent``, ``parent_epoch``, ``children``."""
    epoch = data.get("parent_epoch")
    return {"parent": data.get("parent") or None, "parent_epoch": int(epoch) if epoch else None,
            "children": json.loads(data.get("children") or "[]")}


def _validated(data: dict[str, Any], field: str, paths: dict[str, Any] | None = None) -> ExperimentSpec:
    """The child's spec, or LineageError naming ``set.PATH`` when the first problem is at one of ``paths``."""
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as err:
        loc = ".".join(str(p) for p in err.errors()[0]["loc"])
        why = format_validation_error(err).replace("\n", "; ")
        raise LineageError(f"the child's spec is not valid: {why}",
                           f"set.{loc}" if loc in (paths or {}) else field) from None


def continue_spec(parent: ExperimentSpec, final_epoch: int, epochs: int) -> ExperimentSpec:
    """The parent's spec training ``epochs`` more than its final checkpoint's ``final_epoch``."""
    data = parent.model_dump(mode="json")
    data["training"]["epochs"] = final_epoch + epochs
    return _validated(data, "epochs")


def fixed_field(path: str) -> str | None:
    """The FIXED section or field ``path`` falls in (None: it may change across a checkpoint)."""
    return next((f for f in FIXED if path == f or path.startswith(f"{f}.")), None)


def _put(data: dict[str, Any], path: str, value: Any) -> None:
    *sections, last = path.split(".")
    for name in sections:
        data = data[name]
    data[last] = value


def fork_spec(parent: ExperimentSpec, from_epoch: int, changes: dict[str, Any]) -> ExperimentSpec:
    """The parent's spec with ``changes`` (dotted path -> value) put in; LineageError naming ``set.PATH`` for a
    field that cannot change across a checkpoint, that the spec has not, or a value it refuses; naming
    ``from_epoch`` when the child would have no epoch left to train."""
    data = parent.model_dump(mode="json")
    known = _leaves(data)
    for path, value in changes.items():
        if fixed := fixed_field(path):
            raise LineageError(f"{fixed} cannot change across a checkpoint (the checkpoint's weights "
                               "and optimizer state are the parent's): submit a new experiment instead",
                               f"set.{path}")
        if path not in known:
            raise LineageError(f"the spec has no field {path} to set (e.g. teleport.tau, optimizer.lr, "
                               "training.epochs)", f"set.{path}")
        _put(data, path, value)
    spec = _validated(data, "set", changes)
    if spec.training.epochs <= from_epoch:
        raise LineageError(f"training.epochs={spec.training.epochs} leaves nothing to train after epoch "
                           f"{from_epoch}: set training.epochs above {from_epoch}", "from_epoch")
    return spec
