"""The spec contract: defaults validate, bad input names its field, overrides reach any field."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from api_schemas import ExperimentSpec, SpecError, build_spec, load_spec

SNAPSHOT = Path(__file__).with_name("experiment_spec.schema.json")


def test_defaults_are_the_papers_mnist_settings() -> None:
    spec = ExperimentSpec()
    t = spec.teleport
    assert (t.batches, t.steps, t.batch_size, t.lr, t.cap, t.tau) == (32, 8, 32, 0.2, 5.0, 1.0)
    assert spec.model.kind == "mlp" and spec.model.hidden == [1024, 1024]
    assert spec.training.batch_size == 32


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"teleport": {"tua": 1.0}}, "teleport.tua"),
        ({"teleport": {"tau": 1.5}}, "teleport.tau"),
        ({"teleport": {"lr": -1}}, "teleport.lr"),
        ({"teleport": {"rise": 0}}, "teleport.rise"),
        ({"teleport": {"cap_ratio": 1}}, "teleport.cap_ratio"),
        ({"teleport": {"cap": None}}, "teleport.cap: null leaves the ascent unbounded; set teleport.cap_ratio"),
        ({"model": {"kind": "cnn", "hidden": [3]}}, "model.hidden"),
        ({"model": {"kind": "rnn"}}, "model.kind"),
        ({"optimizer": {"name": "lbfgs"}}, "optimizer.name"),
        ({"dataset": {"name": "mnist"}}, "dataset.root"),
        ({"dataset": {"name": "npz"}}, "dataset.path"),
        ({"training": {"epochs": 3}, "teleport": {"epochs": [3, 5]}}, "teleport.epochs"),
        ({"teleport": {"epochs": [1, 1]}}, "teleport.epochs"),
        ({"teleport": {"method": "symmetry"}}, "model.activation=leaky_relu"),
        ({"model": {"kind": "cnn"}, "teleport": {"method": "symmetry"}}, "model.kind=mlp"),
        ({"resources": {"workers": 0}}, "resources.workers"),
        ({"training": {"precision": "fp8"}}, "training.precision"),
        ({"training": {"precision": "bf16", "dtype": "float64"}}, "training.precision=bf16 needs training.dtype"),
        ({"resources": {"gpus_per_worker": 1.5}}, "resources.gpus_per_worker=1.5: above 1 it is a whole number"),
        ({"resources": {"gpu_memory_gb": 8}}, "resources.gpu_memory_gb is for a job with GPUs"),
        ({"resources": {"gpus_per_worker": 1, "gpu_type": "H100 SXM"}}, "resources.gpu_type"),
        ({"resources": {"gpu_type": "H100"}}, "resources.gpu_type is for a job with GPUs"),
    ],
)
def test_bad_specs_name_the_field(data: dict, needle: str) -> None:
    with pytest.raises(SpecError) as err:
        build_spec(data)
    assert needle in str(err.value)


def test_overrides_reach_any_field_with_typed_values() -> None:
    spec = build_spec({}, ["teleport.tau=0.99", "model.hidden=[64, 32]", "optimizer.name=adam",
                           "teleport.enabled=false", "training.target_loss=0.1"])
    assert spec.teleport.tau == 0.99 and spec.model.hidden == [64, 32]
    assert spec.optimizer.name == "adam" and spec.teleport.enabled is False
    assert spec.training.target_loss == 0.1
    with pytest.raises(SpecError, match="path=value"):
        build_spec({}, ["teleport.tau"])


def test_spec_files_in_yaml_and_json(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("model:\n  kind: cnn\n  channels: [8, 16]\nteleport:\n  tau: 0.999\n")
    (tmp_path / "b.json").write_text(json.dumps({"optimizer": {"name": "adagrad", "lr": 0.1}}))
    a = load_spec(tmp_path / "a.yaml", ["training.epochs=3"])
    assert a.model.kind == "cnn" and a.model.channels == [8, 16] and a.training.epochs == 3
    assert load_spec(tmp_path / "b.json").optimizer.name == "adagrad"
    with pytest.raises(SpecError, match="no such file and no such preset"):
        load_spec(tmp_path / "missing.yaml")
    (tmp_path / "c.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="mapping"):
        load_spec(tmp_path / "c.yaml")


def test_schema_snapshot_is_deliberate() -> None:
    """A change to the contract must update the snapshot: UPDATE_SNAPSHOTS=1 make test."""
    schema = json.dumps(ExperimentSpec.model_json_schema(), indent=1, sort_keys=True) + "\n"
    if os.environ.get("UPDATE_SNAPSHOTS") or not SNAPSHOT.exists():
        SNAPSHOT.write_text(schema)
    assert SNAPSHOT.read_text() == schema, "ExperimentSpec changed: rerun with UPDATE_SNAPSHOTS=1 if deliberate"


def test_the_dataset_schema_says_which_fields_each_kind_takes() -> None:
    schema = ExperimentSpec.model_json_schema()
    kinds = {d["$ref"].rsplit("/", 1)[1] for d in schema["properties"]["dataset"]["oneOf"]}
    props = {k: set(schema["$defs"][k]["properties"]) for k in kinds}
    assert props["BundledDataset"] == {"name", "max_train", "max_test", "test_fraction", "normalize"}
    assert {"factory", "args"} <= props["CustomDataset"] and "factory" not in props["TokensDataset"]
    assert schema["$defs"]["NpzDataset"]["required"] == ["name", "path"]
    for refused, why in [({"name": "digits", "seq_len": 8}, "dataset.seq_len is for name=electricity"),
                         ({"name": "mnist"}, "dataset.root is required for name=mnist"),
                         ({"name": "mnist", "root": "r", "factory": "a.b:c"}, "dataset.factory is for name=custom")]:
        with pytest.raises(ValidationError, match=why):
            ExperimentSpec.model_validate({"dataset": refused})
    spec = ExperimentSpec.model_validate({"dataset": {"name": "tokens", "root": "r", "seq_len": 8}})
    assert spec.dataset.factory is None and spec.dataset.seq_len == 8  # every field still reads, own or not
    assert "factory" not in spec.model_dump()["dataset"]  # and a dump holds the kind's own: it validates again
    assert ExperimentSpec.model_validate(spec.model_dump()) == spec
    assert ExperimentSpec().dataset.name == "digits"
