"""``dataset.name: tokens``: a corpus a lab's own tokenizer wrote (nanoGPT's train.bin / val.bin, or .npy), cut into
next-token windows read from a map of the file, every id checked against the vocabulary, and trained on by the
built-in transformer with teleport, no code of the user's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from api_schemas import SpecError, build_spec
from tests.workers.train.formats import load
from workers.train.data_files import DataFormatError
from workers.train.datasets import DatasetNotFound
from workers.train.loop import run_local

REPO = Path(__file__).resolve().parents[3]


def write_bins(root: Path, train: np.ndarray, val: np.ndarray, dtype: str = "uint16", val_name: str = "val") -> None:
    """As nanoGPT's prepare.py writes them: raw ids, no header."""
    root.mkdir(parents=True, exist_ok=True)
    train.astype(dtype).tofile(root / "train.bin")
    val.astype(dtype).tofile(root / f"{val_name}.bin")


def test_windows_are_the_files_ids_and_their_next_ones(tmp_path: Path) -> None:
    ids = (np.arange(103) * 7) % 50  # ids 0..49
    write_bins(tmp_path, ids, ids[:21])
    b = load(name="tokens", root=str(tmp_path), seq_len=10)
    assert b.task == "lm" and b.input_shape == (10,) and b.num_classes == 50  # the largest id + 1
    assert len(b.train) == 10 and len(b.test) == 2  # (103 - 1) // 10, (21 - 1) // 10
    x, y = b.train[3]
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == ids[30:40].tolist() and y.tolist() == ids[31:41].tolist()
    assert b.train[9][1].tolist() == ids[91:101].tolist()  # the last full window and its next tokens
    with pytest.raises(IndexError):
        b.train[10]
    limited = load(name="tokens", root=str(tmp_path), seq_len=10, max_train=4, max_test=1, vocab_size=64)
    assert len(limited.train) == 4 and len(limited.test) == 1 and limited.num_classes == 64


EPOCH = """
import sys
import psutil
from tests.workers.train.formats import load

me = psutil.Process()
before = me.memory_full_info().pss
b = load(name="tokens", root=sys.argv[1], seq_len=1 << 16)  # its vocabulary check reads every id
for i in range(len(b.train)):
    b.train[i]
print(len(b.train), b.num_classes, (me.memory_full_info().pss - before) / (1 << 20))
"""


def test_an_epoch_over_a_corpus_holds_none_of_it_in_the_jobs_memory(tmp_path: Path) -> None:
    # what resources.memory_gb holds a job to is its processes' proportional set: a mapped page a process touched
    # counts in it (a 32-MiB corpus read through a map: +32 MiB), a page read into the kernel's cache does not.
    # Measured in a process of its own: a long-lived test worker's heap moves by more than that for its own reasons
    write_bins(tmp_path, np.arange(1 << 24) % 60_000, np.arange(1 << 17) % 60_000)  # 32 MiB of uint16
    done = subprocess.run([sys.executable, "-c", EPOCH, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    count, vocab, grown = done.stdout.split()
    assert (int(count), int(vocab)) == (255, 60_000)
    assert float(grown) < 12, f"the process grew {float(grown):.1f} MiB over an epoch of a 32-MiB corpus"


def test_uint32_bins_and_npy_arrays_and_test_bin(tmp_path: Path) -> None:
    big = np.array([70_000, 1, 2, 3, 69_999, 5, 6], dtype=np.int64)
    write_bins(tmp_path / "u32", big, big, "uint32", val_name="test")
    b = load(name="tokens", root=str(tmp_path / "u32"), seq_len=3, token_dtype="uint32")
    assert b.num_classes == 70_001 and b.train[0][0].tolist() == [70_000, 1, 2]
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "train.npy", np.arange(40, dtype=np.int32))
    np.save(tmp_path / "npy" / "val.npy", np.arange(12, dtype=np.int64))
    b = load(name="tokens", root=str(tmp_path / "npy"), seq_len=5)
    assert b.num_classes == 40 and len(b.train) == 7 and len(b.test) == 2
    assert b.train[6][1].tolist() == [31, 32, 33, 34, 35]


def test_bad_token_files_say_which_file_and_what_to_set(tmp_path: Path) -> None:
    write_bins(tmp_path, np.arange(40), np.arange(30))
    with pytest.raises(DataFormatError, match=r"train.bin holds token id 39, outside the vocabulary of "
                                              r"dataset.vocab_size=20: raise dataset.vocab_size"):
        load(name="tokens", root=str(tmp_path), seq_len=4, vocab_size=20)
    with pytest.raises(ValueError, match=r"val.bin has 30 tokens, too few for one sample of dataset.seq_len=30"):
        load(name="tokens", root=str(tmp_path), seq_len=30)
    (tmp_path / "val.bin").write_bytes(b"\x01\x00\x02")  # 3 bytes: no whole number of uint16
    with pytest.raises(DataFormatError, match=r"val.bin has 3 bytes, not a whole number of uint16 token ids: set "
                                              r"dataset.token_dtype"):
        load(name="tokens", root=str(tmp_path), seq_len=4)
    (tmp_path / "val.bin").unlink()
    with pytest.raises(DatasetNotFound, match=r"expected train.bin and val.bin \(or test.bin"):
        load(name="tokens", root=str(tmp_path), seq_len=4)
    np.save(tmp_path / "val.npy", np.zeros((4, 8), dtype=np.int64))
    with pytest.raises(DataFormatError, match=r"val.npy holds a int64 array of shape \(4, 8\): it needs one dim"):
        load(name="tokens", root=str(tmp_path), seq_len=4)
    np.save(tmp_path / "val.npy", np.array([{"x": 1}, 2], dtype=object), allow_pickle=True)
    with pytest.raises(DataFormatError, match=r"val.npy: not a .npy array \(ValueError\)"):  # data is never code
        load(name="tokens", root=str(tmp_path), seq_len=4)
    np.save(tmp_path / "val.npy", np.array([3, -1, 2, 4, 5, 6], dtype=np.int16))
    with pytest.raises(DataFormatError, match=r"val.npy holds token id -1"):
        load(name="tokens", root=str(tmp_path), seq_len=4)


def test_the_spec_keeps_the_token_fields_to_tokens() -> None:
    with pytest.raises(SpecError, match="dataset.vocab_size is for name=tokens only, not name=digits"):
        build_spec({"dataset": {"name": "digits", "vocab_size": 100}})
    with pytest.raises(SpecError, match="dataset.root is required for name=tokens"):
        build_spec({"dataset": {"name": "tokens"}})
    with pytest.raises(SpecError, match="dataset.token_dtype"):
        build_spec({"dataset": {"name": "tokens", "root": "x", "token_dtype": "int8"}})


def test_a_transformer_trains_on_a_token_corpus_and_teleports_on_its_level_set(tmp_path: Path) -> None:
    text = np.frombuffer(Path(__file__).read_bytes(), dtype=np.uint8)  # bytes as token ids, as a char LM's
    cut = len(text) * 9 // 10
    write_bins(tmp_path / "corpus", text[:cut], text[cut:])
    spec = build_spec({
        "model": {"kind": "transformer", "heads": 2, "head_dim": 8, "layers": 1},
        "dataset": {"name": "tokens", "root": str(tmp_path / "corpus"), "seq_len": 16, "max_train": 64,
                    "max_test": 16},
        "optimizer": {"name": "adamw", "lr": 0.003},
        "training": {"epochs": 2, "batch_size": 16, "seed": 0},
        "teleport": {"epochs": [0], "batches": 2, "batch_size": 2, "steps": 2, "cap": 1e6, "budget": None},
    })
    summary = run_local(spec, tmp_path / "run", progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    teleports = [r for r in records if r["kind"] == "teleport"]
    assert len(teleports) == 2 and all(r["steps"] > 0 for r in teleports)
    for r in teleports:  # float32: the guard's loss_tol (1e-3) bounds the drift on its batch
        assert r["loss_after"] == pytest.approx(r["loss_before"], rel=2e-3)
        assert r["grad_norm_sq_after"] > r["grad_norm_sq_before"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert len(epochs) == 2 and epochs[1]["train_loss"] < epochs[0]["train_loss"] and "test_ppl" in epochs[1]
    assert summary["final_test_loss"] == epochs[1]["test_loss"]
