"""Data is never code, and never leaks into an error: crafted CIFAR pickles, .npz archives and checkpoints
are refused before anything in them runs; a bad data file is named by path and line, never quoted."""

from __future__ import annotations

import gzip
import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from api_schemas import build_spec
from workers.train.context import CheckpointRefused, read_checkpoint, write_checkpoint
from workers.train.data_bundle import DataBundle
from workers.train.data_files import DataFormatError
from workers.train.datasets import load_dataset

SECRET = "root:x:0:0:hunter2-secret:/root:/bin/bash"


def load(**dataset: Any) -> DataBundle:
    return load_dataset(build_spec({"dataset": dataset}).dataset, 0)


def one_line_naming(err: BaseException, path: Path) -> str:
    msg = str(err)
    assert "\n" not in msg and str(path) in msg, msg
    return msg


class Payload:
    """Unpickling this runs ``os.system(command)``, as a crafted data file would."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


class Call:
    """Unpickling this calls ``fn(arg)`` (``builtins.eval``, ``builtins.exec``, ...)."""

    def __init__(self, fn: Any, arg: str) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (self.fn, (self.arg,))


# ---------------------------------------------------------------------------------- CIFAR pickles


class Py2Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """Writes as Python 2's cPickle did for the real CIFAR files: protocol 2, byte strings as BINSTRING."""

    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def save_bytes(self, obj: bytes) -> None:
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + len(obj).to_bytes(4, "little") + obj)
        self.memoize(obj)

    dispatch[bytes] = save_bytes


def py2_cifar_bytes(batch: dict) -> bytes:
    buf = io.BytesIO()
    Py2Pickler(buf, protocol=2).dump(batch)
    # numpy 1.x (and so every real CIFAR file) names the reconstructor numpy.core.multiarray
    return buf.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")


def cifar_bytes(batch: dict, protocol: int) -> bytes:
    """A batch as Python 2 wrote it (protocol 2), or as Python 3 does (4: the default until 3.14, then 5)."""
    return py2_cifar_bytes(batch) if protocol == 2 else pickle.dumps(batch, protocol=protocol)


def write_cifar10(folder: Path, test_batch: bytes | None = None) -> np.ndarray:
    folder.mkdir(parents=True, exist_ok=True)
    rows = np.random.default_rng(0).integers(0, 256, (2, 3072), dtype=np.uint8)
    for i in range(1, 6):
        (folder / f"data_batch_{i}").write_bytes(
            py2_cifar_bytes({b"batch_label": b"training batch", b"data": rows, b"labels": [i, 9 - i]}))
    (folder / "test_batch").write_bytes(test_batch or py2_cifar_bytes({b"data": rows, b"labels": [0, 1]}))
    return rows


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar_batches_of_every_pickle_protocol_load(tmp_path: Path, protocol: int) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    rows = write_cifar10(folder)
    test = np.arange(3 * 3072).reshape(3, 3072).astype(np.uint8)
    (folder / "test_batch").write_bytes(cifar_bytes({b"data": test, b"labels": [0, 1, 7]}, protocol))
    if protocol == 2:
        assert b"numpy.core.multiarray" in (folder / "test_batch").read_bytes()
    b = load(name="cifar10", root=str(tmp_path), normalize=False)
    (x, y), (xtr, ytr) = b.test.tensors, b.train.tensors
    assert y.tolist() == [0, 1, 7] and ytr.tolist() == [1, 8, 2, 7, 3, 6, 4, 5, 5, 4]
    np.testing.assert_allclose(x[2].numpy().reshape(-1), test[2] / np.float32(255), rtol=0, atol=1e-7)
    np.testing.assert_allclose(xtr[1].numpy().reshape(-1), rows[1] / np.float32(255), rtol=0, atol=1e-7)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_reduce_payload_in_a_cifar_batch_never_runs(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    evil = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1], b"x": Payload(f"touch {marker}")}
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder, test_batch=cifar_bytes(evil, protocol))
    with pytest.raises(DataFormatError) as err:
        load(name="cifar10", root=str(tmp_path))
    msg = one_line_naming(err.value, folder / "test_batch")
    assert "system" in msg and "refused" in msg
    assert not marker.exists()
    assert pickle.loads(pickle.dumps(Payload(f"touch {marker}"))) == 0 and marker.exists()  # the payload is real


@pytest.mark.parametrize("fn", [eval, exec, getattr, __import__])
def test_builtins_are_refused(tmp_path: Path, fn: Any) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder, test_batch=pickle.dumps({b"data": Call(fn, "1"), b"labels": []}))
    with pytest.raises(DataFormatError, match=f"builtins.{fn.__name__}"):
        load(name="cifar10", root=str(tmp_path))


def test_truncated_or_foreign_cifar_batches_name_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    good = py2_cifar_bytes({b"data": np.zeros((1, 3072), np.uint8), b"labels": [0]})
    for content, expected in [(good[:-40], "not a CIFAR python batch"), (SECRET.encode(), "not a CIFAR python batch"),
                              (pickle.dumps({b"labels": [0]}), "keys data, labels")]:
        write_cifar10(folder, test_batch=content)
        with pytest.raises(DataFormatError, match=expected) as err:
            load(name="cifar10", root=str(tmp_path))
        assert "hunter2" not in one_line_naming(err.value, folder / "test_batch")


# ------------------------------------------------------------------------- text never echoed


def test_a_symlinked_secret_is_named_by_line_never_quoted(tmp_path: Path) -> None:
    secret = tmp_path / "passwd"
    secret.write_text("1,2\n3,4\n" + SECRET + "\n5,6\n")
    (tmp_path / "electricity.txt").symlink_to(secret)
    with pytest.raises(DataFormatError) as err:
        load(name="electricity", root=str(tmp_path))
    msg = one_line_naming(err.value, tmp_path / "electricity.txt")
    assert "line 3" in msg and "hunter2" not in msg and "root" not in msg.replace(str(tmp_path), "")
    passwd = Path("/etc/passwd")
    if passwd.is_file():  # a real system file
        (tmp_path / "traffic.txt").symlink_to(passwd)
        with pytest.raises(DataFormatError, match="line 1 ") as err:
            load(name="traffic", root=str(tmp_path))
        msg = one_line_naming(err.value, tmp_path / "traffic.txt").replace(str(tmp_path), "")
        assert "root" not in msg and not any(line in msg for line in passwd.read_text().splitlines() if line)


@pytest.mark.parametrize(("text", "line"), [("1 2\n3 4 5\n", 2), ("1,2\n\n# note\n3,x\n", 4)])
def test_ragged_or_non_numeric_rows_name_their_line(tmp_path: Path, text: str, line: int) -> None:
    (tmp_path / "traffic.txt").write_text(text)
    with pytest.raises(DataFormatError, match=f"line {line} is not a row of numbers"):
        load(name="traffic", root=str(tmp_path))


def test_bad_gzip_and_non_utf8_text_are_not_quoted(tmp_path: Path) -> None:
    (tmp_path / "electricity.txt.gz").write_bytes(SECRET.encode())
    with pytest.raises(DataFormatError, match="not a readable gzip file") as err:
        load(name="electricity", root=str(tmp_path))
    assert "root" not in one_line_naming(err.value, tmp_path / "electricity.txt.gz").replace(str(tmp_path), "")
    (tmp_path / "electricity.txt.gz").write_bytes(gzip.compress(b"1,2\n3,4\n\xff" + SECRET.encode()))
    with pytest.raises(DataFormatError, match="line 3 is not UTF-8") as err:
        load(name="electricity", root=str(tmp_path))
    assert "hunter2" not in str(err.value)


# ------------------------------------------------------------------------------------------ npz


def test_npz_object_arrays_never_unpickle(tmp_path: Path) -> None:
    marker, path = tmp_path / "pwned", tmp_path / "d.npz"
    y = np.empty(2, dtype=object)
    y[:] = [Payload(f"touch {marker}"), 1]
    np.savez(path, X=np.zeros((2, 3)), y=y)
    with pytest.raises(DataFormatError, match="not a numeric array") as err:
        load(name="npz", path=str(path))
    one_line_naming(err.value, path)
    assert not marker.exists()


def test_npz_that_is_not_an_archive(tmp_path: Path) -> None:
    text, single = tmp_path / "passwd.npz", tmp_path / "one.npz"
    text.write_text(SECRET + "\n")
    np.save(single, np.zeros(3))
    (tmp_path / "one.npz.npy").rename(single)
    for path, expected in [(text, "not a .npz archive"), (single, "a single .npy array")]:
        with pytest.raises(DataFormatError, match=expected) as err:
            load(name="npz", path=str(path))
        assert "hunter2" not in one_line_naming(err.value, path)


# ------------------------------------------------------------------------------------ checkpoints


def test_checkpoints_round_trip_through_weights_only(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    state = {"epoch": 2, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "history": [{"epoch": 0, "train_loss": np.float64(1.5)}], "rng": np.arange(3), "seconds": 1.0}
    write_checkpoint(state, tmp_path)
    back = read_checkpoint(tmp_path)
    assert back["history"] == [{"epoch": 0, "train_loss": 1.5}] and type(back["history"][0]["train_loss"]) is float
    assert torch.equal(back["rng"], torch.arange(3)) and back["epoch"] == 2
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fresh.load_state_dict(back["model"])
    torch.optim.Adam(fresh.parameters()).load_state_dict(back["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(),
                                                  strict=True))
    assert (tmp_path / "meta.json").read_text() == '{"epoch": 2}'


def test_a_checkpoint_with_code_is_refused_unrun(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save({"epoch": 1, "model": Payload(f"touch {marker}")}, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointRefused, match="system") as err:
        read_checkpoint(tmp_path)
    one_line_naming(err.value, tmp_path / "checkpoint.pt")
    assert not marker.exists()
