"""The pure rules the service checks at submit: the model-takes-the-data rule is the one the workers' model
builder applies, the built-in shapes are the loaders' shapes, and a sweep's space is capped before any value
is validated."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from pydantic import ValidationError

from api_schemas.compat import check_model_data
from api_schemas.datasets import FILELESS, DatasetNotFound, required_files, sample_shape
from api_schemas.spec import DatasetSpec, ExperimentSpec
from api_schemas.sweeps import MAX_TRIALS, MAX_VALUES, SweepSubmit, probe_values
from workers.train.datasets import load_dataset
from workers.train.models import build_model

BUILT_IN = ["digits", "synthetic", "mnist", "fashion_mnist", "cifar10", "cifar100", "tiny_imagenet", "smnist",
            "electricity", "traffic", "ptb"]
MODELS: list[dict[str, Any]] = [
    {"kind": "mlp", "hidden": [8]}, {"kind": "cnn", "channels": [4]}, {"kind": "resnet", "channels": [4, 4]},
    {"kind": "transformer", "heads": 1, "head_dim": 4, "layers": 1, "max_len": 1024},
    {"kind": "transformer", "heads": 1, "head_dim": 4, "layers": 1, "max_len": 100},
]


def spec_for(model: dict[str, Any], dataset: str) -> ExperimentSpec:
    files = {} if dataset in FILELESS else {"root": "r"}
    return ExperimentSpec.model_validate({"model": model, "dataset": {"name": dataset, **files}})


@pytest.mark.parametrize("dataset", BUILT_IN)
@pytest.mark.parametrize("model", MODELS, ids=lambda m: f"{m['kind']}-{m.get('max_len', '')}")
def test_submit_refuses_exactly_what_the_model_builder_refuses(model: dict[str, Any], dataset: str) -> None:
    spec = spec_for(model, dataset)
    shape = sample_shape(spec.dataset)
    assert shape is not None
    concrete = tuple(3 if s is None else s for s in shape.input_shape)  # a series' column count: any
    classes = 10 if shape.task != "regression" else None
    try:
        build_model(spec.model, task=shape.task, input_shape=concrete, num_classes=classes,
                    output_dim=3 if shape.task == "regression" else None, dataset=dataset)
        built = None
    except ValueError as err:
        built = str(err)
    try:
        check_model_data(spec.model, shape.task, shape.input_shape, dataset)
        checked = None
    except ValueError as err:
        checked = str(err).replace("(168, D)", "(168, 3)")
    assert checked == built


@pytest.mark.parametrize("name", sorted(FILELESS))
def test_the_known_shapes_are_the_loaders_shapes(name: str) -> None:
    spec = DatasetSpec(name=name)  # type: ignore[arg-type]
    data, shape = load_dataset(spec), sample_shape(spec)
    assert shape is not None and (data.task, data.input_shape) == (shape.task, shape.input_shape)
    assert required_files(spec) == []


def test_required_files_name_what_is_missing(tmp_path: Any) -> None:
    with pytest.raises(DatasetNotFound, match="train-images-idx3-ubyte") as err:
        required_files(DatasetSpec(name="mnist", root=str(tmp_path)))
    assert str(tmp_path) in str(err.value)
    (tmp_path / "ptb").mkdir()
    for f in ("ptb.train.txt", "ptb.test.txt"):
        (tmp_path / "ptb" / f).write_text("a b\n")
    assert [p.name for p in required_files(DatasetSpec(name="ptb", root=str(tmp_path)))] == ["ptb.train.txt",
                                                                                            "ptb.test.txt"]


def sweep(space: dict[str, Any], **kw: Any) -> SweepSubmit:
    return SweepSubmit.model_validate({"base": {"dataset": {"name": "digits"}}, "search_space": space, **kw})


def test_a_huge_grid_is_refused_before_any_value_is_validated() -> None:
    body = json.dumps({"base": {}, "search_space": {"training.seed": {"grid": list(range(150_000))}}})
    t0 = time.perf_counter()
    with pytest.raises(ValidationError, match=f"150000 values; at most {MAX_VALUES}"):
        SweepSubmit.model_validate_json(body)
    print(f"refused in {(time.perf_counter() - t0) * 1000:.1f} ms")
    side = int(MAX_TRIALS ** 0.5) + 1
    with pytest.raises(ValidationError, match="trials"):
        sweep({"training.seed": {"grid": list(range(side))}, "teleport.lr": {"grid": [0.1 + i for i in range(side)]}})
    with pytest.raises(ValidationError, match="value 0 is not valid"):  # still every distinct value, once
        sweep({"training.epochs": {"choice": [1, 2, 0]}})
    assert probe_values("grid", [1, 1, 2, {"a": 1}, {"a": 1}]) == [1, 2, {"a": 1}]
    assert sweep({"training.seed": {"grid": [0, 0, 1]}}).trial_count() == 3  # a repeated value still runs
