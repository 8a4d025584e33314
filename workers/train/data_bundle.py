"""What every data loader returns: the built-in ones (``workers.train.datasets``) and the user's own factory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.utils.data import Dataset

Task = Literal["classification", "regression", "lm"]


@dataclass(frozen=True)
class DataBundle:
    train: Dataset
    test: Dataset
    task: Task
    input_shape: tuple[int, ...]  # one sample's x
    num_classes: int | None  # classes, or the vocabulary size for lm
    output_dim: int | None  # regression target size
    name: str
