"""The image loaders against tiny files written in their real on-disk formats: MNIST/FashionMNIST IDX (raw and
gzipped), CIFAR-10/100 python pickles, Tiny-ImageNet folders."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.workers.train.formats import load, tensors
from workers.train.datasets import DatasetNotFound

# ------------------------------------------------------------------------------------ MNIST IDX

N_TRAIN, N_TEST = 5, 3


def idx_bytes(array: np.ndarray) -> bytes:
    """IDX: 0x00 0x00, dtype 0x08 (ubyte), ndim, then big-endian int32 dims and the data."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}i", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def mnist_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    xtr = rng.integers(0, 256, (N_TRAIN, 28, 28), dtype=np.uint8)
    xte = rng.integers(0, 256, (N_TEST, 28, 28), dtype=np.uint8)
    xtr[0, 0, 0], xtr[0, 0, 1] = 255, 0
    return {
        "train-images-idx3-ubyte": xtr,
        "train-labels-idx1-ubyte": np.array([3, 1, 4, 1, 5], dtype=np.uint8),
        "t10k-images-idx3-ubyte": xte,
        "t10k-labels-idx1-ubyte": np.array([9, 2, 6], dtype=np.uint8),
    }


def write_mnist(root: Path, gz: bool) -> dict[str, np.ndarray]:
    arrays = mnist_arrays()
    folder = root / "raw" if gz else root
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        data = idx_bytes(array)
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / name).write_bytes(data)
    return arrays


def test_idx_magic_numbers() -> None:
    arrays = mnist_arrays()
    assert idx_bytes(arrays["train-images-idx3-ubyte"])[:4] == b"\x00\x00\x08\x03"
    assert idx_bytes(arrays["train-labels-idx1-ubyte"])[:8] == b"\x00\x00\x08\x01" + struct.pack(">i", N_TRAIN)


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
@pytest.mark.parametrize("gz", [False, True], ids=["raw-in-root", "gz-in-root-raw"])
def test_mnist_idx(tmp_path: Path, name: str, gz: bool) -> None:
    arrays = write_mnist(tmp_path, gz)
    b = load(name=name, root=str(tmp_path), normalize=False)
    xtr, ytr = tensors(b.train)
    xte, yte = tensors(b.test)
    assert xtr.shape == (N_TRAIN, 1, 28, 28) and xte.shape == (N_TEST, 1, 28, 28)
    assert xtr.dtype == torch.float32 and ytr.dtype == torch.int64
    assert b.input_shape == (1, 28, 28) and b.num_classes == 10 and b.task == "classification"
    assert ytr.tolist() == [3, 1, 4, 1, 5] and yte.tolist() == [9, 2, 6]
    assert xtr[0, 0, 0, 0].item() == 1.0 and xtr[0, 0, 0, 1].item() == 0.0
    expected = arrays["t10k-images-idx3-ubyte"].astype(np.float32) / np.float32(255)
    np.testing.assert_allclose(xte[:, 0].numpy(), expected, rtol=0, atol=1e-7)
    assert float(xtr.min()) >= 0.0 and float(xtr.max()) <= 1.0


def test_mnist_max_train_and_normalize(tmp_path: Path) -> None:
    write_mnist(tmp_path, gz=False)
    b = load(name="mnist", root=str(tmp_path), max_train=2, max_test=1)
    xtr, ytr = tensors(b.train)
    assert xtr.shape == (2, 1, 28, 28) and ytr.tolist() == [3, 1] and len(b.test) == 1
    assert abs(float(xtr.mean())) < 1e-4 and abs(float(xtr.std(correction=0)) - 1.0) < 1e-3


def test_smnist_row_major_sequences(tmp_path: Path) -> None:
    arrays = write_mnist(tmp_path, gz=True)
    b = load(name="smnist", root=str(tmp_path), normalize=False)
    xtr, ytr = tensors(b.train)
    assert xtr.shape == (N_TRAIN, 784, 1) and b.input_shape == (784, 1) and b.num_classes == 10
    image = arrays["train-images-idx3-ubyte"][2].astype(np.float32) / np.float32(255)
    np.testing.assert_allclose(xtr[2, :, 0].numpy(), image.reshape(-1), rtol=0, atol=1e-7)
    assert xtr[2, 28 + 5, 0].item() == pytest.approx(float(image[1, 5]))  # pixel (row 1, col 5)
    assert ytr.tolist() == [3, 1, 4, 1, 5]


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist", "smnist"])
def test_mnist_missing_files(tmp_path: Path, name: str) -> None:
    (tmp_path / "train-images-idx3-ubyte").write_bytes(idx_bytes(mnist_arrays()["train-images-idx3-ubyte"]))
    with pytest.raises(DatasetNotFound) as err:
        load(name=name, root=str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path) in msg and "t10k-labels-idx1-ubyte" in msg and "train-labels-idx1-ubyte" in msg


# ---------------------------------------------------------------------------------- CIFAR pickles


def cifar_rows(n: int, offset: int) -> np.ndarray:
    rng = np.random.default_rng(offset)
    return rng.integers(0, 256, (n, 3072), dtype=np.uint8)


def write_cifar(parent: Path, ten: bool) -> tuple[Path, np.ndarray, list[int], np.ndarray, list[int]]:
    """2 rows per batch; returns the folder and the concatenated train/test data and labels."""
    folder = parent / ("cifar-10-batches-py" if ten else "cifar-100-python")
    folder.mkdir(parents=True)
    label_key = b"labels" if ten else b"fine_labels"
    train_names = [f"data_batch_{i}" for i in range(1, 6)] if ten else ["train"]
    classes = 10 if ten else 100
    xtr, ytr = [], []
    for i, fname in enumerate(train_names):
        data, labels = cifar_rows(2, i), [(7 * i + 3) % classes, (11 * i + 97) % classes]
        extra = {b"coarse_labels": [0, 1]} if not ten else {}
        with (folder / fname).open("wb") as f:
            pickle.dump({b"batch_label": b"x", b"data": data, label_key: labels, **extra}, f)
        xtr.append(data)
        ytr += labels
    xte, yte = cifar_rows(3, 99), [classes - 1, 0, 5]
    with (folder / ("test_batch" if ten else "test")).open("wb") as f:
        pickle.dump({b"data": xte, label_key: yte}, f)
    return folder, np.concatenate(xtr), ytr, xte, yte


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
@pytest.mark.parametrize("at", ["folder", "parent"])
def test_cifar_pickles(tmp_path: Path, name: str, at: str) -> None:
    ten = name == "cifar10"
    folder, xtr_raw, ytr_raw, xte_raw, yte_raw = write_cifar(tmp_path, ten)
    b = load(name=name, root=str(folder if at == "folder" else tmp_path), normalize=False)
    xtr, ytr = tensors(b.train)
    xte, yte = tensors(b.test)
    assert xtr.shape == (10 if ten else 2, 3, 32, 32) and xte.shape == (3, 3, 32, 32)
    assert xtr.dtype == torch.float32 and ytr.dtype == torch.int64
    assert b.input_shape == (3, 32, 32) and b.num_classes == (10 if ten else 100)
    assert ytr.tolist() == ytr_raw and yte.tolist() == yte_raw
    # channel layout: bytes 0..1023 are the red plane, row-major 32x32; then green, then blue
    red = xte_raw[1, :1024].reshape(32, 32).astype(np.float32) / np.float32(255)
    np.testing.assert_allclose(xte[1, 0].numpy(), red, rtol=0, atol=1e-7)
    blue = xtr_raw[-1, 2048:].reshape(32, 32).astype(np.float32) / np.float32(255)
    np.testing.assert_allclose(xtr[-1, 2].numpy(), blue, rtol=0, atol=1e-7)
    assert xte[1, 0, 0, 1].item() == pytest.approx(xte_raw[1, 1] / 255)
    assert xte[1, 1, 1, 0].item() == pytest.approx(xte_raw[1, 1024 + 32] / 255)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_max_train(tmp_path: Path, name: str) -> None:
    folder, _, ytr_raw, _, _ = write_cifar(tmp_path, name == "cifar10")
    b = load(name=name, root=str(tmp_path), max_train=1, max_test=2)
    assert len(b.train) == 1 and len(b.test) == 2 and tensors(b.train)[1].tolist() == ytr_raw[:1]


@pytest.mark.parametrize(("name", "expected"), [("cifar10", "test_batch"), ("cifar100", "test")])
def test_cifar_missing_files(tmp_path: Path, name: str, expected: str) -> None:
    with pytest.raises(DatasetNotFound) as err:
        load(name=name, root=str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path) in msg and expected in msg
    folder, *_ = write_cifar(tmp_path, name == "cifar10")
    (folder / expected).unlink()
    with pytest.raises(DatasetNotFound) as err:
        load(name=name, root=str(tmp_path))
    assert str(folder) in str(err.value) and expected in str(err.value)


# ---------------------------------------------------------------------------------- Tiny-ImageNet

WNIDS = ["n01443537", "n09999999"]
COLORS = {"n01443537": (250, 5, 5), "n09999999": (5, 5, 250)}  # red class 0, blue class 1


def write_tiny(parent: Path) -> Path:
    from PIL import Image

    base = parent / "tiny-imagenet-200"
    (base / "val" / "images").mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(WNIDS) + "\n")
    for w in WNIDS:
        (base / "train" / w / "images").mkdir(parents=True)
        for k in range(2):
            Image.new("RGB", (20, 20), COLORS[w]).save(base / "train" / w / "images" / f"{w}_{k}.JPEG")
    lines = []
    for k, w in enumerate(["n09999999", "n01443537", "n09999999"]):
        Image.new("RGB", (24, 24), COLORS[w]).save(base / "val" / "images" / f"val_{k}.JPEG")
        lines.append(f"val_{k}.JPEG\t{w}\t0\t0\t20\t20")
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return base


@pytest.mark.parametrize("at", ["parent", "folder"])
def test_tiny_imagenet_tree(tmp_path: Path, at: str) -> None:
    base = write_tiny(tmp_path)
    b = load(name="tiny_imagenet", root=str(tmp_path if at == "parent" else base), image_size=16, normalize=False)
    xtr, ytr = tensors(b.train)
    xte, yte = tensors(b.test)
    assert xtr.shape == (4, 3, 16, 16) and xte.shape == (3, 3, 16, 16) and b.input_shape == (3, 16, 16)
    assert xtr.dtype == torch.float32 and ytr.dtype == torch.int64
    assert b.num_classes == 2 and b.task == "classification"
    assert ytr.tolist() == [0, 0, 1, 1] and yte.tolist() == [1, 0, 1]
    # the label follows the colour: class 0 red, class 1 blue
    for x, y in [*zip(xtr, ytr, strict=True), *zip(xte, yte, strict=True)]:
        red, blue = float(x[0].mean()), float(x[2].mean())
        assert (red > 0.8 and blue < 0.2) if y == 0 else (blue > 0.8 and red < 0.2)


def test_tiny_imagenet_default_size_and_limits(tmp_path: Path) -> None:
    write_tiny(tmp_path)
    b = load(name="tiny_imagenet", root=str(tmp_path), max_train=3, max_test=1)
    assert tensors(b.train)[0].shape == (3, 3, 64, 64) and len(b.test) == 1


def test_tiny_imagenet_missing(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFound) as err:
        load(name="tiny_imagenet", root=str(tmp_path))
    assert str(tmp_path) in str(err.value) and "wnids.txt" in str(err.value)
    assert "val_annotations.txt" in str(err.value)
    base = write_tiny(tmp_path)
    (base / "val" / "val_annotations.txt").unlink()
    with pytest.raises(DatasetNotFound, match="val_annotations.txt") as err:
        load(name="tiny_imagenet", root=str(tmp_path))
    assert str(base) in str(err.value)
