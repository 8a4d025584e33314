"""``dataset: {name: custom, factory: "pkg.module:function", args: {...}}``: the user's own data.

The factory returns ``(train, test)``, two torch ``Dataset``s (anything with ``__len__`` and ``__getitem__``)
whose items are ``(x, y)`` pairs of tensors, arrays or numbers. The task is read from the first training item:
float targets are regression, an integer scalar target is classification, integer targets with a shape (one per
position) are language modelling. The number of classes (or the vocabulary) is the dataset's ``num_classes`` or
``vocab_size`` attribute when it has one, else the largest label + 1 over the training set (read when it has at
most ``SCAN_LIMIT`` items). ``dataset.max_train``/``max_test`` keep the first N items; ``normalize`` does not
apply: the factory returns the data as it should be fed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from api_schemas.spec import DatasetSpec
from workers.train.data_bundle import DataBundle, Task
from workers.train.user_code import UserCodeError, call, definition, resolve

SCAN_LIMIT = 100_000  # training items read to find the number of classes when the dataset does not say


def _refuse(spec: DatasetSpec, what: str) -> UserCodeError:
    where = definition(resolve(spec.factory or "", "dataset.factory"))
    return UserCodeError(f"{where + ': ' if where else ''}dataset.factory {spec.factory} {what}")


def _check_split(spec: DatasetSpec, name: str, ds: Any) -> None:
    if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
        raise _refuse(spec, f"returned a {type(ds).__name__} as the {name} set, not a torch Dataset "
                            "(__len__ and __getitem__)")
    if len(ds) == 0:
        raise _refuse(spec, f"returned an empty {name} set")


def _pair(spec: DatasetSpec, item: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(item, tuple | list) and len(item) == 2):
        raise _refuse(spec, f"gives items of type {type(item).__name__}, not (x, y) pairs: return (x, y) from "
                            "__getitem__")
    try:
        return torch.as_tensor(item[0]), torch.as_tensor(item[1])
    except (TypeError, ValueError, RuntimeError) as err:
        raise _refuse(spec, f"gives an (x, y) pair that is not tensors, arrays or numbers ({err})") from None


def task_of(y: torch.Tensor) -> Task:
    """Float targets: regression; an integer scalar: classification; integers with a shape: lm (per position)."""
    if y.is_floating_point():
        return "regression"
    return "classification" if y.dim() == 0 else "lm"


def class_count(ds: Dataset, task: Task) -> int | None:
    """``num_classes``/``vocab_size`` of the dataset, else the largest label + 1 (None for regression, or when
    the set is too large to read here)."""
    if task == "regression":
        return None
    for attr in ("num_classes", "vocab_size"):
        value = getattr(ds, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    n = len(ds)  # type: ignore[arg-type]
    if n > SCAN_LIMIT:
        return None
    return 1 + max(int(torch.as_tensor(ds[i][1]).max()) for i in range(n))


def _first(ds: Dataset, limit: int | None) -> Dataset:
    n = len(ds)  # type: ignore[arg-type]
    return ds if limit is None or limit >= n else Subset(ds, range(limit))


def load_custom(spec: DatasetSpec, seed: int) -> DataBundle:
    """The user's ``(train, test)``, checked item by shape and type, as a DataBundle."""
    out = call(spec.factory or "", "dataset.factory", dict(spec.args))
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise _refuse(spec, f"returned a {type(out).__name__}, not (train, test): return the two Datasets")
    train, test = out
    _check_split(spec, "train", train)
    _check_split(spec, "test", test)
    x, y = _pair(spec, train[0])
    task = task_of(y)
    _, y_test = _pair(spec, test[0])
    if task_of(y_test) != task:
        raise _refuse(spec, f"gives {task} targets in the train set but {task_of(y_test)} ones in the test set")
    return DataBundle(_first(train, spec.max_train), _first(test, spec.max_test), task, tuple(x.shape),
                      class_count(train, task), int(y.numel()) if task == "regression" else None,
                      spec.factory or "custom")


def check_targets(loss: str | None, data: DataBundle) -> None:
    """A built-in ``training.loss`` fits the dataset's targets: cross_entropy integer ones, mse float ones."""
    integer = data.task != "regression"
    if loss == "cross_entropy" and not integer:
        raise ValueError(f"training.loss=cross_entropy needs integer class targets; {data.name} gives float ones: "
                         "use training.loss=mse, or return integer labels")
    if loss == "mse" and integer:
        raise ValueError(f"training.loss=mse needs float targets; {data.name} gives integer ones: use "
                         "training.loss=cross_entropy, or return float targets")
