"""Reading users' data files so that data is never code and never leaks into an error.

A CIFAR batch is unpickled by ``DataUnpickler``, which admits numpy's array reconstruction and
refuses every other global before it can be called; ``.npz`` archives load with
``allow_pickle=False``; text is parsed by numpy, and when a line is bad the error names its
number, never its text (``electricity.txt`` may be a symlink to ``/etc/passwd``). Every error is
a one-line ``DataFormatError`` that names the file.
"""

from __future__ import annotations

import gzip
import os
import pickle
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from api_schemas.datasets import TokenFileError, raw_token_count


class DataFormatError(ValueError):
    """A data file is not in its format; the message names the file (and line), never its contents."""


def read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped when it ends in .gz."""
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        return gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as err:  # gzip's message quotes the file's first bytes
        raise DataFormatError(f"{path}: not a readable gzip file ({type(err).__name__}): "
                              f"recompress it or give it uncompressed without .gz") from None


def read_text(path: Path) -> str:
    """The file as UTF-8 text (gunzipped when .gz)."""
    raw = read_bytes(path)
    try:
        return raw.decode()
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise DataFormatError(f"{path}: line {line} is not UTF-8 text: save the file as UTF-8") from None


# ---------------------------------------------------------------------------- pickles (CIFAR)

# what a CIFAR python batch references: numpy's array reconstruction (its module was numpy.core before
# numpy 2; pickle protocol 5, Python 3.14's default, rebuilds an array from its buffer instead); dicts,
# lists, bytes, str and numbers are pickle opcodes and need no global at all
_RECONSTRUCT = np.ndarray((0,)).__reduce__()[0]
_FROMBUFFER = np.zeros(1).__reduce_ex__(5)[0]
CIFAR_GLOBALS: dict[tuple[str, str], object] = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy.core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy._core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class DataUnpickler(pickle.Unpickler):
    """Reads pickled numpy arrays, lists, dicts, strings and numbers; refuses every other global
    (``os.system``, ``builtins.eval``, ...) before anything is called."""

    def __init__(self, file: BinaryIO, path: Path) -> None:
        super().__init__(file, encoding="bytes")  # Python 2 str -> bytes, as the CIFAR files expect
        self.path = path

    def find_class(self, module: str, name: str) -> object:
        found = CIFAR_GLOBALS.get((module, name))
        if found is None:
            raise DataFormatError(f"{self.path}: refused: the pickle references {module}.{name}, which a CIFAR "
                                  f"batch never holds (only numpy arrays, lists, dicts, strings, numbers); "
                                  f"nothing in it was run")
        return found


def read_pickled_batch(path: Path, keys: tuple[bytes, ...]) -> dict:
    """One CIFAR python batch: a dict holding at least ``keys``, read without running anything."""
    with path.open("rb") as f:
        try:
            batch = DataUnpickler(f, path).load()
        except DataFormatError:
            raise
        except Exception as err:  # truncated or not a pickle: the message could quote the bytes
            raise DataFormatError(f"{path}: not a CIFAR python batch ({type(err).__name__} while unpickling): "
                                  f"replace it with the file from the CIFAR python archive") from None
    if not isinstance(batch, dict) or not all(k in batch for k in keys):
        raise DataFormatError(f"{path}: not a CIFAR python batch: it needs a dict with keys "
                              f"{', '.join(k.decode() for k in keys)}")
    return batch


# ---------------------------------------------------------------------------- text matrices


def _bad_line(lines: list[str], delimiter: str | None) -> int:
    """The 1-based number of the first line that is not a row of as many numbers as the first row."""
    width = None
    for number, line in enumerate(lines, start=1):
        data = line.split("#", 1)[0]  # loadtxt's comments
        if not data.strip():
            continue
        fields = data.split(delimiter)
        try:
            list(map(float, fields))
        except ValueError:
            return number
        if width is not None and len(fields) != width:
            return number
        width = len(fields)
    return len(lines)


def read_matrix(path: Path) -> np.ndarray:
    """A text matrix (rows = time steps, columns = series), comma- or whitespace-separated, or .gz."""
    text = read_text(path)
    lines = text.splitlines()
    delimiter = "," if "," in text.split("\n", 1)[0] else None
    try:
        return np.loadtxt(lines, delimiter=delimiter, dtype=np.float32, ndmin=2)
    except ValueError:  # numpy's message quotes the offending text: name the line instead
        raise DataFormatError(f"{path}: line {_bad_line(lines, delimiter)} is not a row of numbers like the "
                              f"first (a text matrix: one row per time step, comma- or whitespace-separated)"
                              ) from None


# ---------------------------------------------------------------------------- npz


def read_npz_xy(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Arrays X (as float32) and y of a .npz archive, read without unpickling anything."""
    try:
        f = np.load(path, allow_pickle=False)
    except Exception as err:  # not a zip/npy, or pickled objects: numpy's message may quote the bytes
        raise DataFormatError(f"dataset.path: {path}: not a .npz archive of numeric arrays "
                              f"({type(err).__name__}): write it with numpy.savez(path, X=..., y=...)") from None
    if not isinstance(f, np.lib.npyio.NpzFile):
        raise DataFormatError(f"dataset.path: {path}: a single .npy array, not a .npz archive: "
                              f"write it with numpy.savez(path, X=..., y=...)")
    with f:
        if "X" not in f or "y" not in f:
            raise DataFormatError(f"dataset npz: {path} has arrays {sorted(f.files)}; it needs X and y")
        try:
            return f["X"].astype(np.float32), f["y"]
        except ValueError as err:  # an object array would need pickle: refused
            raise DataFormatError(f"dataset.path: {path}: X or y is not a numeric array ({err})") from None


# ---------------------------------------------------------------------------- token files


@dataclass(frozen=True)
class TokenFile:
    """A file of token ids, read where asked (``os.pread``), never mapped: a mapped page a process touched counts in
    its resident memory (what ``resources.memory_gb`` holds a job to), and an epoch over a mapped corpus touches all
    of it; a read leaves the pages to the kernel's cache."""

    path: Path
    dtype: np.dtype
    offset: int  # bytes before the first id (a .npy's header)
    count: int  # ids

    def read_into(self, fd: int, start: int, out: np.ndarray) -> np.ndarray:
        """Ids ``[start, start + len(out))`` from ``fd`` (this file, opened by the caller) read into ``out``; the part
        filled (all of it unless the file ends)."""
        got = os.preadv(fd, [memoryview(out).cast("B")], self.offset + start * self.dtype.itemsize)
        return out[: got // self.dtype.itemsize]


def read_tokens(path: Path, dtype: str) -> TokenFile:
    """A file of token ids: a ``.bin`` of raw ``dtype`` integers (nanoGPT's train.bin,
    ``np.array(ids, dtype).tofile(path)``) or a ``.npy`` of one integer dimension (read without unpickling)."""
    if path.suffix == ".npy":
        try:  # mapped for its header only (dtype, shape, where the ids begin); no id is touched
            mapped = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as err:  # numpy's message may quote the header's bytes
            raise DataFormatError(f"dataset tokens: {path}: not a .npy array ({type(err).__name__}): write it "
                                  f"with numpy.save(path, ids)") from None
        kind, shape, offset = mapped.dtype, mapped.shape, int(getattr(mapped, "offset", 0))
        del mapped
        if len(shape) != 1 or not np.issubdtype(kind, np.integer):
            raise DataFormatError(f"dataset tokens: {path} holds a {kind} array of shape {shape}: it needs one "
                                  f"dimension of integer token ids")
        return TokenFile(path, kind, offset, shape[0])
    try:
        return TokenFile(path, np.dtype(dtype), 0, raw_token_count(path, dtype))
    except TokenFileError as err:
        raise DataFormatError(str(err)) from None
