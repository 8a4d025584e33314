"""Character-level text from a standard-library module's own source file: real text, shipped with Python.

Characters map to 97 ids: 0 for anything unusual, 1 for a newline, 2..96 for printable ASCII. Items are
``(x, y)`` with ``y`` the next character of each position of ``x`` (both int64 (seq_len,)), so the service
trains it as a language model (a loss per position) and reports perplexity.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch.utils.data import Dataset

VOCAB = 97


def encode(text: str) -> torch.Tensor:
    ids = [1 if c == "\n" else ord(c) - 30 if 32 <= ord(c) < 127 else 0 for c in text]
    return torch.tensor(ids, dtype=torch.long)


class Windows(Dataset):
    """Windows of ``seq_len`` characters, ``stride`` apart, and the same window shifted by one."""

    vocab_size = VOCAB  # the service reads it as the number of classes

    def __init__(self, ids: torch.Tensor, seq_len: int, stride: int) -> None:
        self.ids, self.seq_len = ids, seq_len
        self.starts = list(range(0, len(ids) - seq_len - 1, stride))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.starts[i]
        return self.ids[s : s + self.seq_len], self.ids[s + 1 : s + self.seq_len + 1]


def python_source(module: str = "json.decoder", seq_len: int = 32, stride: int = 16, max_chars: int = 40_000,
                  test_fraction: float = 0.1) -> tuple[Dataset, Dataset]:
    """The factory: ``dataset: {name: custom, factory: "tiny_lm.data:python_source", args: {...}}``; the last
    ``test_fraction`` of the text is the test set."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ValueError(f"module {module!r} has no Python source file to read")
    ids = encode(Path(spec.origin).read_text(encoding="utf-8")[:max_chars])
    cut = int(len(ids) * (1 - test_fraction))
    return Windows(ids[:cut], seq_len, stride), Windows(ids[cut:], seq_len, stride)
