"""Helpers shared by the dataset-format tests: load a built-in dataset from a spec's ``dataset`` section."""

from __future__ import annotations

from typing import Any

import torch

from api_schemas import build_spec
from workers.train.data_bundle import DataBundle
from workers.train.datasets import load_dataset


def load(seed: int = 0, **dataset: Any) -> DataBundle:
    return load_dataset(build_spec({"dataset": dataset}).dataset, seed)


def tensors(ds: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return ds.tensors[0], ds.tensors[1]
