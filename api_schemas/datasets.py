"""What each built-in dataset is without reading it: its task, one sample's shape, the files it needs.

Shared by the workers' loaders (``workers/train/datasets.py`` finds its files here) and the service's checks at
submit (``service/api/admission.py``), so the two never disagree on a file name. Pure stdlib: existence and
size checks only, nothing is opened.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from api_schemas.spec import DatasetSpec

DEFAULT_WINDOW = 168  # electricity/traffic hours per sample when dataset.seq_len is not set
DEFAULT_PTB_LEN = 256  # PTB tokens per sample when dataset.seq_len is not set
DEFAULT_IMAGE = 64  # Tiny-ImageNet side when dataset.image_size is not set

MNIST_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
               "t10k-labels-idx1-ubyte"]
MNIST_SUBDIRS = ("", "raw", "MNIST/raw", "FashionMNIST/raw")
PTB_FILES = ["ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"]
FILELESS = ("digits", "synthetic")  # generated or bundled: no dataset.root, no files
TOKEN_SPLITS = (("train",), ("val", "test"))  # tokens: train.bin (or .npy), and val.bin or test.bin (or .npy)
TINY_NEEDED = ["wnids.txt", "train/<wnid>/images/*.JPEG", "val/val_annotations.txt", "val/images/*.JPEG"]


class DatasetNotFound(FileNotFoundError):
    """The expected files are not there; the message names them, the directory and the fix."""


@dataclass(frozen=True)
class SampleShape:
    """A dataset's task and one sample's x; None in the shape = known only from the files."""

    task: str
    input_shape: tuple[int | None, ...]


def sample_shape(spec: DatasetSpec) -> SampleShape | None:
    """The task and sample shape of a built-in dataset (None for ``npz``: only its file knows)."""
    if spec.name in ("mnist", "fashion_mnist"):
        return SampleShape("classification", (1, 28, 28))
    side = spec.image_size or DEFAULT_IMAGE
    shapes = {
        "digits": SampleShape("classification", (1, 8, 8)),
        "synthetic": SampleShape("classification", (20,)),
        "smnist": SampleShape("classification", (784, 1)),
        "cifar10": SampleShape("classification", (3, 32, 32)),
        "cifar100": SampleShape("classification", (3, 32, 32)),
        "tiny_imagenet": SampleShape("classification", (3, side, side)),
        "electricity": SampleShape("regression", (spec.seq_len or DEFAULT_WINDOW, None)),
        "traffic": SampleShape("regression", (spec.seq_len or DEFAULT_WINDOW, None)),
        "ptb": SampleShape("lm", (spec.seq_len or DEFAULT_PTB_LEN,)),
        "tokens": SampleShape("lm", (spec.seq_len or DEFAULT_PTB_LEN,)),
    }
    return shapes.get(spec.name)


def missing(name: str, root: Path, files: list[str]) -> DatasetNotFound:
    return DatasetNotFound(
        f"dataset {name}: expected {', '.join(files)} in {root} — put the files there or set dataset.root "
        f"to the directory that holds them (no downloads: this machine may be offline)"
    )


def find(root: Path, names: list[str], subdirs: tuple[str, ...] = ("",)) -> Path | None:
    """The first existing ``root/sub/name`` (names may be given with or without .gz)."""
    for sub in subdirs:
        for name in names:
            for candidate in (root / sub / name, root / sub / f"{name}.gz"):
                if candidate.exists():
                    return candidate
    return None


def mnist_files(name: str, root: Path) -> list[Path]:
    """The four IDX files (train/test images/labels) of MNIST, FashionMNIST or sMNIST."""
    paths = [find(root, [f], MNIST_SUBDIRS) for f in MNIST_FILES]
    if any(p is None for p in paths):
        raise missing(name, root, MNIST_FILES)
    return [p for p in paths if p is not None]


def cifar_files(name: str, root: Path) -> tuple[list[Path], list[Path]]:
    """CIFAR-10/100 python batches: (train files, test files), in ``root`` or its archive's folder."""
    ten = name == "cifar10"
    folder = "cifar-10-batches-py" if ten else "cifar-100-python"
    train = [f"data_batch_{i}" for i in range(1, 6)] if ten else ["train"]
    test = ["test_batch"] if ten else ["test"]
    base = root / folder if (root / folder).is_dir() else root
    if not all((base / f).exists() for f in train + test):
        raise missing(name, base, train + test if base.name == folder else [f"{folder}/{f}" for f in train + test])
    return [base / f for f in train], [base / f for f in test]


def tiny_imagenet_base(root: Path) -> Path:
    """The Tiny-ImageNet folder (``root`` or ``root/tiny-imagenet-200``) holding wnids.txt and val/."""
    base = root / "tiny-imagenet-200" if (root / "tiny-imagenet-200").is_dir() else root
    if not (base / "wnids.txt").exists() or not (base / "val" / "val_annotations.txt").exists():
        raise missing("tiny_imagenet", base, TINY_NEEDED)
    return base


def series_file(name: str, root: Path) -> Path:
    """electricity/traffic: ``<name>.txt`` or ``.csv`` (or .gz), in ``root`` or ``root/<name>``."""
    path = find(root, [f"{name}.txt", f"{name}.csv"], ("", name))
    if path is None:
        raise missing(name, root, [f"{name}.txt (or .csv / .gz)"])
    return path


def ptb_files(root: Path) -> tuple[Path, Path | None, Path]:
    """PTB's train, valid (optional) and test text files, in ``root`` or ``root/ptb``."""
    train, valid, test = (find(root, [f], ("", "ptb")) for f in PTB_FILES)
    if train is None or test is None:
        raise missing("ptb", root, PTB_FILES)
    return train, valid, test


def token_files(root: Path) -> tuple[Path, Path]:
    """tokens: the train and test token files in ``root``: ``train.bin`` and ``val.bin`` (nanoGPT's; or
    ``test.bin``), or the same names as ``.npy``."""
    found = [next((root / f"{n}.{ext}" for ext in ("bin", "npy") for n in names if (root / f"{n}.{ext}").is_file()),
                  None) for names in TOKEN_SPLITS]
    train, test = found
    if train is None or test is None:
        raise missing("tokens", root, ["train.bin and val.bin (or test.bin; or the same as .npy)"])
    return train, test


class TokenFileError(ValueError):
    """A token file that cannot fit the spec, known from its size alone; ``field`` is the dataset field to change."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


BYTES_PER_ID = {"uint16": 2, "uint32": 4}


def raw_token_count(path: Path, dtype: str) -> int:
    """The ids in a raw ``.bin`` token file of ``dtype`` integers, from its size (a stat, nothing read)."""
    size, itemsize = path.stat().st_size, BYTES_PER_ID[dtype]
    if size == 0 or size % itemsize:
        raise TokenFileError(f"dataset tokens: {path} has {size} bytes, not a whole number of {dtype} token ids: set "
                             f"dataset.token_dtype to the type it was written with (uint16 or uint32)", "token_dtype")
    return size // itemsize


def check_token_sizes(spec: DatasetSpec) -> None:
    """``tokens``: each ``.bin`` holds whole ids of ``dataset.token_dtype`` and more than one sample of ``seq_len``
    (TokenFileError naming the field); a ``.npy``'s count is in its header, read by the loader."""
    dtype, seq = spec.token_dtype or "uint16", spec.seq_len or DEFAULT_PTB_LEN
    for path in token_files(Path(spec.root or ".")):
        if path.suffix == ".bin":
            check_token_count(path, raw_token_count(path, dtype), seq)


def check_token_count(path: Path, count: int, seq: int) -> None:
    """A token file of ``count`` ids gives a sample of ``seq`` and its next token, else TokenFileError."""
    if count <= seq:
        raise TokenFileError(f"dataset tokens: {path} has {count} tokens, too few for one sample of "
                             f"dataset.seq_len={seq} and its next token: lower dataset.seq_len", "seq_len")


def npz_file(path: Path) -> Path:
    if not path.is_file():
        raise DatasetNotFound(f"dataset.path: {path}: no such file — set dataset.path to a .npz with arrays X, y")
    return path


def required_files(spec: DatasetSpec) -> list[Path]:
    """The files the dataset reads first (raises DatasetNotFound naming what is missing); [] = none needed."""
    root = Path(spec.root or ".")
    if spec.name in ("mnist", "fashion_mnist", "smnist"):
        return mnist_files(spec.name, root)
    if spec.name in ("cifar10", "cifar100"):
        train, test = cifar_files(spec.name, root)
        return train + test
    if spec.name == "tiny_imagenet":
        base = tiny_imagenet_base(root)
        return [base / "wnids.txt", base / "val" / "val_annotations.txt"]
    if spec.name in ("electricity", "traffic"):
        return [series_file(spec.name, root)]
    if spec.name == "ptb":
        return [p for p in ptb_files(root) if p is not None]
    if spec.name == "tokens":
        return list(token_files(root))
    if spec.name == "npz":
        return [npz_file(Path(spec.path or ""))]
    return []
