"""``dataset.name: tokens``: a language model's corpus as token ids a lab's own tokenizer wrote, trained on without
code of theirs: ``train.bin`` and ``val.bin`` (nanoGPT's format: raw uint16 or uint32 ids), or ``.npy`` arrays.

The files are mapped, not read: a sample is cut from the map when the loader asks for it, so a corpus of billions
of tokens costs no memory up front. Each sample is ``dataset.seq_len`` tokens and its next-token targets (windows
that do not overlap, as for ptb). Every id is checked against the vocabulary once, at load: an id past it would
index out of the embedding (on CUDA, a device-side assert that ends the process, naming nothing).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from api_schemas.datasets import DEFAULT_PTB_LEN, token_files
from api_schemas.spec import DatasetSpec
from workers.train.data_bundle import DataBundle
from workers.train.data_files import DataFormatError, read_tokens

CHUNK = 1 << 24  # ids scanned at a time for the vocabulary check (128 MiB as int64 at most)


class TokenWindows(Dataset):
    """Sample i: ids ``[i·T, (i+1)·T)`` as x and the ids one further as y (int64 tensors of T), read from the map."""

    def __init__(self, ids: np.ndarray, seq_len: int, limit: int | None) -> None:
        self.ids, self.seq_len = ids, seq_len
        self.count = min((len(ids) - 1) // seq_len, limit or len(ids))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(f"sample {i} of {self.count}")
        window = torch.from_numpy(np.array(self.ids[i * self.seq_len: (i + 1) * self.seq_len + 1], dtype=np.int64))
        return window[:-1], window[1:]


def id_range(ids: np.ndarray) -> tuple[int, int]:
    """The smallest and largest id, scanned a chunk at a time."""
    low, high = 0, 0
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start: start + CHUNK]
        low, high = min(low, int(chunk.min())), max(high, int(chunk.max()))
    return low, high


def load_tokens(spec: DatasetSpec, seed: int) -> DataBundle:
    """train.bin/val.bin (or .npy) under ``dataset.root`` as next-token windows of ``dataset.seq_len``."""
    seq = spec.seq_len or DEFAULT_PTB_LEN
    splits = []
    for path, limit in zip(token_files(Path(spec.root or ".")), (spec.max_train, spec.max_test), strict=True):
        ids = read_tokens(path, spec.token_dtype or "uint16")
        if len(ids) <= seq:
            raise ValueError(f"dataset tokens: {path} has {len(ids)} tokens, too few for one sample of "
                             f"dataset.seq_len={seq} and its next token: lower dataset.seq_len")
        splits.append((path, ids, TokenWindows(ids, seq, limit)))
    ranges = [id_range(ids) for _, ids, _ in splits]
    vocab = spec.vocab_size or max(high for _, high in ranges) + 1
    for (path, _, _), (low, high) in zip(splits, ranges, strict=True):
        if low < 0 or high >= vocab:
            raise DataFormatError(f"dataset tokens: {path} holds token id {low if low < 0 else high}, outside the "
                                  f"vocabulary of dataset.vocab_size={vocab}: raise dataset.vocab_size (or leave "
                                  f"it unset: the largest id + 1)")
    return DataBundle(splits[0][2], splits[1][2], "lm", (seq,), vocab, None, "tokens")
