"""The pydantic contract shared by the CLI, the service, the scheduler and the workers."""

from api_schemas.spec import (
    CNNModel,
    CustomModel,
    DatasetSpec,
    ExperimentSpec,
    MLPModel,
    OptimizerSpec,
    ResNetModel,
    ResourcesSpec,
    TeleportSpec,
    TrainingSpec,
    TransformerModel,
)
from api_schemas.spec_io import SpecError, apply_overrides, build_spec, load_spec

__all__ = [
    "CNNModel",
    "CustomModel",
    "DatasetSpec",
    "ExperimentSpec",
    "MLPModel",
    "OptimizerSpec",
    "ResNetModel",
    "ResourcesSpec",
    "SpecError",
    "TeleportSpec",
    "TrainingSpec",
    "TransformerModel",
    "apply_overrides",
    "build_spec",
    "load_spec",
]
