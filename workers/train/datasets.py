"""Offline datasets in their standard on-disk formats, as in-memory tensor datasets.

No downloads: each loader reads the files a lab already has (IDX, CIFAR pickles, image folders,
text matrices, PTB text, token files) from ``dataset.root``; a missing file raises ``DatasetNotFound`` naming
the directory searched and the files expected. ``digits`` (bundled with scikit-learn) and
``synthetic`` need no files; ``npz`` reads a user's own arrays ``X`` and ``y``; ``custom`` calls the user's
own factory (``workers.train.custom_data``).

Data is never code: files are read through ``workers.train.data_files`` (a restricted unpickler for
CIFAR batches, ``allow_pickle=False`` for .npz, errors that name a bad line by its number and never
repeat a file's contents).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from api_schemas.datasets import (
    DEFAULT_IMAGE,
    DEFAULT_PTB_LEN,
    DEFAULT_WINDOW,
    TINY_NEEDED,
    cifar_files,
    missing,
    mnist_files,
    npz_file,
    ptb_files,
    series_file,
    tiny_imagenet_base,
)
from api_schemas.datasets import DatasetNotFound as DatasetNotFound  # the loaders raise it; callers import it here
from api_schemas.spec import DatasetSpec
from workers.train.custom_data import load_custom  # the user's own dataset.factory
from workers.train.data_bundle import DataBundle
from workers.train.data_files import (
    DataFormatError,
    read_bytes,
    read_matrix,
    read_npz_xy,
    read_pickled_batch,
    read_text,
)
from workers.train.token_data import load_tokens  # dataset.name: tokens (train.bin / val.bin)


def _standardize(train: np.ndarray, test: np.ndarray, axis: int | tuple[int, ...] | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    mean = train.mean(axis=axis, keepdims=axis is not None)
    std = train.std(axis=axis, keepdims=axis is not None) + 1e-8
    return (train - mean) / std, (test - mean) / std


def _classification(name: str, xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, yte: np.ndarray,
                    spec: DatasetSpec, classes: int | None = None) -> DataBundle:
    xtr, ytr, xte, yte = xtr[: spec.max_train], ytr[: spec.max_train], xte[: spec.max_test], yte[: spec.max_test]
    xtr, xte = xtr.astype(np.float32), xte.astype(np.float32)
    if spec.normalize:
        xtr, xte = _standardize(xtr, xte)
    num = classes if classes is not None else int(max(ytr.max(initial=0), yte.max(initial=0))) + 1
    return DataBundle(
        TensorDataset(torch.from_numpy(np.ascontiguousarray(xtr)), torch.from_numpy(ytr.astype(np.int64))),
        TensorDataset(torch.from_numpy(np.ascontiguousarray(xte)), torch.from_numpy(yte.astype(np.int64))),
        "classification", tuple(xtr.shape[1:]), num, None, name,
    )


def _split(n: int, fraction: float, seed: int, labels: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Seeded train/test indices; stratified by ``labels`` when given."""
    rng = np.random.default_rng(seed)
    if labels is None:
        perm = rng.permutation(n)
        cut = n - max(1, int(round(n * fraction)))
        return perm[:cut], perm[cut:]
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = max(1, int(round(len(idx) * fraction)))
        test.append(idx[:k])
        train.append(idx[k:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


# ----------------------------------------------------------------------- the loaders


def digits_file() -> Path:
    """scikit-learn's bundled ``digits.csv.gz``, found without importing scikit-learn (its import pulls in
    scipy and pandas: ~0.85 s of a job's start-up)."""
    found = importlib.util.find_spec("sklearn")
    if found is None or not found.submodule_search_locations:
        raise DatasetNotFound("dataset.name: digits needs scikit-learn installed (it bundles the file)")
    return Path(next(iter(found.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"


def load_digits(spec: DatasetSpec, seed: int) -> DataBundle:
    """scikit-learn's bundled 8×8 digits (1,797 images, offline): a stratified seeded split."""
    table = np.loadtxt(digits_file(), delimiter=",")  # what sklearn.datasets.load_digits reads: 64 pixels, label
    x, y = table[:, :-1], table[:, -1].astype(np.int64)
    x = (x / 16.0).reshape(-1, 1, 8, 8)
    tr, te = _split(len(x), spec.test_fraction, seed, y)
    return _classification("digits", x[tr], y[tr], x[te], y[te], spec, classes=10)


def load_synthetic(spec: DatasetSpec, seed: int) -> DataBundle:
    """512 samples of 20 features, 4 classes given by a random linear teacher (seeded)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((512, 20))
    y = (x @ rng.standard_normal((20, 4))).argmax(axis=1)
    tr, te = _split(len(x), spec.test_fraction, seed)
    return _classification("synthetic", x[tr], y[tr], x[te], y[te], spec, classes=4)


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (raw or .gz): magic 0x00 0x00 <dtype> <ndim>, big-endian int32 dims, then the data."""
    raw = read_bytes(path)
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if len(raw) < 4 or raw[:2] != b"\x00\x00" or raw[2] not in dtypes:
        raise DataFormatError(f"{path} is not an IDX file (bad magic number)")
    dtype, ndim = np.dtype(dtypes[raw[2]]), raw[3]
    try:
        dims = np.frombuffer(raw, dtype=">i4", count=ndim, offset=4)
        data = np.frombuffer(raw, dtype=dtype, count=int(np.prod(dims)), offset=4 + 4 * ndim)
    except ValueError:
        raise DataFormatError(f"{path}: IDX file shorter than its header says (truncated?)") from None
    return data.reshape(tuple(int(d) for d in dims)).astype(dtype.newbyteorder("="))


def _mnist_arrays(name: str, root: Path) -> list[np.ndarray]:
    return [read_idx(p) for p in mnist_files(name, root)]


def load_mnist(spec: DatasetSpec, seed: int) -> DataBundle:
    """MNIST / FashionMNIST IDX files -> (1, 28, 28) images scaled to [0, 1]."""
    xtr, ytr, xte, yte = _mnist_arrays(spec.name, Path(spec.root or "."))
    return _classification(spec.name, xtr[:, None] / 255.0, ytr, xte[:, None] / 255.0, yte, spec, classes=10)


def load_smnist(spec: DatasetSpec, seed: int) -> DataBundle:
    """Sequential MNIST: each image as a sequence of 784 pixels of dimension 1."""
    xtr, ytr, xte, yte = _mnist_arrays("smnist", Path(spec.root or "."))
    return _classification("smnist", xtr.reshape(-1, 784, 1) / 255.0, ytr, xte.reshape(-1, 784, 1) / 255.0,
                           yte, spec, classes=10)


def load_cifar(spec: DatasetSpec, seed: int) -> DataBundle:
    """CIFAR-10/100 python pickles (dicts with b'data' (N, 3072) uint8 and the labels)."""
    ten = spec.name == "cifar10"
    train_files, test_files = cifar_files(spec.name, Path(spec.root or "."))
    label_key = b"labels" if ten else b"fine_labels"

    def read(paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
        parts = [read_pickled_batch(p, (b"data", label_key)) for p in paths]
        x = np.concatenate([np.asarray(p[b"data"], dtype=np.uint8) for p in parts]).reshape(-1, 3, 32, 32)
        return x / 255.0, np.concatenate([np.asarray(p[label_key]) for p in parts])

    (xtr, ytr), (xte, yte) = read(train_files), read(test_files)
    return _classification(spec.name, xtr, ytr, xte, yte, spec, classes=10 if ten else 100)


def load_tiny_imagenet(spec: DatasetSpec, seed: int) -> DataBundle:
    """Tiny-ImageNet folders: train/<wnid>/images/*.JPEG, val/images + val_annotations.txt (as test)."""
    from PIL import Image

    base = tiny_imagenet_base(Path(spec.root or "."))
    wnids = read_text(base / "wnids.txt").split()
    index = {w: i for i, w in enumerate(wnids)}
    size = spec.image_size or DEFAULT_IMAGE

    def image(path: Path) -> np.ndarray:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB").resize((size, size)), dtype=np.float32).transpose(2, 0, 1) / 255.0

    train = [(p, index[w]) for w in wnids for p in sorted((base / "train" / w / "images").glob("*.JPEG"))]
    val = []
    for line in read_text(base / "val" / "val_annotations.txt").splitlines():
        parts = line.split("\t")
        if len(parts) >= 2 and parts[1] in index:
            val.append((base / "val" / "images" / parts[0], index[parts[1]]))
    train, val = train[: spec.max_train], val[: spec.max_test]
    if not train or not val:
        raise missing("tiny_imagenet", base, TINY_NEEDED)
    xtr = np.stack([image(p) for p, _ in train])
    xte = np.stack([image(p) for p, _ in val])
    return _classification("tiny_imagenet", xtr, np.array([c for _, c in train]), xte,
                           np.array([c for _, c in val]), spec, classes=len(wnids))


def load_series(spec: DatasetSpec, seed: int) -> DataBundle:
    """electricity / traffic: a window of ``seq_len`` hours in, the row ``horizon`` hours after it out."""
    series = read_matrix(series_file(spec.name, Path(spec.root or ".")))  # (hours, series)
    window, horizon = spec.seq_len or DEFAULT_WINDOW, spec.horizon
    count = len(series) - window - horizon + 1
    if count < 2:
        raise ValueError(f"dataset {spec.name}: {len(series)} rows are too few for dataset.seq_len={window} and "
                         f"dataset.horizon={horizon}: lower them")
    cut = count - max(1, int(round(count * spec.test_fraction)))  # chronological: the last windows are test
    if spec.normalize:  # per series, with the statistics of the rows the training windows see
        seen = series[: cut + window + horizon - 1]
        series = (series - seen.mean(axis=0)) / (seen.std(axis=0) + 1e-8)
    starts = np.arange(count)
    x = np.lib.stride_tricks.sliding_window_view(series, window, axis=0)[:count].transpose(0, 2, 1)  # (N, T, D)
    y = series[starts + window + horizon - 1]  # (N, D)
    tr, te = slice(0, cut), slice(cut, count)
    xtr, ytr = x[tr][: spec.max_train], y[tr][: spec.max_train]
    xte, yte = x[te][: spec.max_test], y[te][: spec.max_test]
    # x is a read-only view of ``series``; one window is already contiguous, so demand a writable copy
    xtr, xte = np.require(xtr, requirements=["C", "W"]), np.require(xte, requirements=["C", "W"])
    return DataBundle(
        TensorDataset(torch.from_numpy(xtr), torch.from_numpy(np.ascontiguousarray(ytr))),
        TensorDataset(torch.from_numpy(xte), torch.from_numpy(np.ascontiguousarray(yte))),
        "regression", (window, series.shape[1]), None, series.shape[1], spec.name,
    )


def load_ptb(spec: DatasetSpec, seed: int) -> DataBundle:
    """Penn Treebank word level: vocabulary from ptb.train.txt (+ <unk>, <eos>), next-token targets."""
    train_path, _valid, test_path = ptb_files(Path(spec.root or "."))

    def words(path: Path) -> list[str]:
        return [w for line in read_text(path).splitlines() for w in [*line.split(), "<eos>"]]

    train_words = words(train_path)
    vocab = {w: i for i, w in enumerate(sorted(set(train_words) | {"<unk>", "<eos>"}))}
    seq = spec.seq_len or DEFAULT_PTB_LEN

    def chunks(tokens: list[str], limit: int | None) -> TensorDataset:
        ids = torch.tensor([vocab.get(w, vocab["<unk>"]) for w in tokens], dtype=torch.long)
        n = (len(ids) - 1) // seq
        if n < 1:
            raise ValueError(f"dataset ptb: {len(ids)} tokens are too few for dataset.seq_len={seq}: lower it")
        x = ids[: n * seq].view(n, seq)[:limit]
        y = ids[1 : n * seq + 1].view(n, seq)[:limit]
        return TensorDataset(x, y)

    return DataBundle(chunks(train_words, spec.max_train), chunks(words(test_path), spec.max_test), "lm", (seq,),
                      len(vocab), None, "ptb")


def load_npz(spec: DatasetSpec, seed: int) -> DataBundle:
    """A user's .npz with arrays X and y: integer y = classification, float y = regression."""
    x, y = read_npz_xy(npz_file(Path(spec.path or "")))
    if len(x) != len(y):
        raise ValueError(f"dataset npz: X has {len(x)} rows but y has {len(y)}")
    integer = np.issubdtype(y.dtype, np.integer)
    tr, te = _split(len(x), spec.test_fraction, seed, y if integer else None)
    if integer:
        return _classification("npz", x[tr], y[tr], x[te], y[te], spec)
    y = y.astype(np.float32).reshape(len(y), -1)
    xtr, ytr = x[tr][: spec.max_train], y[tr][: spec.max_train]
    xte, yte = x[te][: spec.max_test], y[te][: spec.max_test]
    if spec.normalize:
        xtr, xte = _standardize(xtr, xte, axis=0)
    return DataBundle(TensorDataset(torch.from_numpy(xtr), torch.from_numpy(ytr)),
                      TensorDataset(torch.from_numpy(xte), torch.from_numpy(yte)),
                      "regression", tuple(xtr.shape[1:]), None, y.shape[1], "npz")


LOADERS: dict[str, Callable[[DatasetSpec, int], DataBundle]] = {
    "digits": load_digits,
    "synthetic": load_synthetic,
    "mnist": load_mnist,
    "fashion_mnist": load_mnist,
    "smnist": load_smnist,
    "cifar10": load_cifar,
    "cifar100": load_cifar,
    "tiny_imagenet": load_tiny_imagenet,
    "electricity": load_series,
    "traffic": load_series,
    "ptb": load_ptb,
    "tokens": load_tokens,
    "npz": load_npz,
    "custom": load_custom,
}


def load_dataset(spec: DatasetSpec, seed: int = 0) -> DataBundle:
    """The dataset named by ``spec.name``, split into train and test."""
    return LOADERS[spec.name](spec, seed)
