"""``dataset.name: tokens``: a language model's corpus as token ids a lab's own tokenizer wrote, trained on without
code of theirs: ``train.bin`` and ``val.bin`` (nanoGPT's format: raw uint16 or uint32 ids), or ``.npy`` arrays.

The files are not loaded: a sample's ids are read from its file when the loader asks for them (``os.pread``, not a
memory map, whose touched pages would count in the job's memory), so a corpus of billions of tokens costs none.
Each sample is ``dataset.seq_len`` tokens and its next-token targets (windows that do not overlap, as for ptb).
Every id is checked against the vocabulary once, at load: an id past it would index out of the embedding (on
CUDA, a device-side assert that ends the process, naming nothing).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from api_schemas.datasets import DEFAULT_PTB_LEN, check_token_count, token_files
from api_schemas.spec import DatasetSpec
from workers.train.data_bundle import DataBundle
from workers.train.data_files import DataFormatError, TokenFile, read_tokens

CHUNK = 1 << 22  # ids read at a time for the vocabulary check (32 MiB of uint64 at most)


class TokenWindows(Dataset):
    """Sample i: ids ``[i·T, (i+1)·T)`` as x and the ids one further as y (int64 tensors of T), read from the file
    when asked (its descriptor opened once per process)."""

    def __init__(self, tokens: TokenFile, seq_len: int, limit: int | None) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.count = min((tokens.count - 1) // seq_len, limit or tokens.count)
        self._fd: int | None = None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(f"sample {i} of {self.count}")
        if self._fd is None:
            self._fd = os.open(self.tokens.path, os.O_RDONLY)
        ids = self.tokens.read_into(self._fd, i * self.seq_len, np.empty(self.seq_len + 1, self.tokens.dtype))
        window = torch.from_numpy(ids.astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:  # a copy in another process opens its own descriptor
        return {**self.__dict__, "_fd": None}

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


def id_range(tokens: TokenFile) -> tuple[int, int]:
    """The smallest and largest id of the file, read a chunk at a time into one buffer (a fresh buffer a chunk
    would stay in the allocator's heap once freed: glibc raises its mmap threshold to a freed block's size)."""
    low, high = 0, 0
    buffer = np.empty(min(CHUNK, tokens.count), dtype=tokens.dtype)
    fd = os.open(tokens.path, os.O_RDONLY)
    try:
        for start in range(0, tokens.count, CHUNK):
            chunk = tokens.read_into(fd, start, buffer[: min(CHUNK, tokens.count - start)])
            low, high = min(low, int(chunk.min())), max(high, int(chunk.max()))
    finally:
        os.close(fd)
    return low, high


def load_tokens(spec: DatasetSpec, seed: int) -> DataBundle:
    """train.bin/val.bin (or .npy) under ``dataset.root`` as next-token windows of ``dataset.seq_len``."""
    seq = spec.seq_len or DEFAULT_PTB_LEN
    files = [read_tokens(path, spec.token_dtype or "uint16") for path in token_files(Path(spec.root or "."))]
    for tokens in files:
        check_token_count(tokens.path, tokens.count, seq)
    ranges = [id_range(tokens) for tokens in files]
    vocab = spec.vocab_size or max(high for _, high in ranges) + 1
    for path, (low, high) in zip((t.path for t in files), ranges, strict=True):
        if low < 0 or high >= vocab:
            raise DataFormatError(f"dataset tokens: {path} holds token id {low if low < 0 else high}, outside the "
                                  f"vocabulary of dataset.vocab_size={vocab}: raise dataset.vocab_size (or leave "
                                  f"it unset: the largest id + 1)")
    train, test = (TokenWindows(t, seq, limit) for t, limit in zip(files, (spec.max_train, spec.max_test), strict=True))
    return DataBundle(train, test, "lm", (seq,), vocab, None, "tokens")
