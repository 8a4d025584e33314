"""The other offline loaders against tiny files in their real formats (electricity/traffic text matrices, PTB
text, npz), plus the bundled digits and synthetic sets. Image formats: test_image_formats.py."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.workers.train.formats import load, tensors
from workers.train.datasets import DatasetNotFound, load_dataset

# ------------------------------------------------------------------------ electricity / traffic

ROWS, COLS, WINDOW, HORIZON = 30, 3, 5, 2


def series_matrix() -> np.ndarray:
    t = np.arange(ROWS, dtype=np.float32)[:, None]
    return 10 * t + np.arange(COLS, dtype=np.float32)  # row t, column d holds 10 t + d


def write_series(root: Path, name: str, fmt: str) -> None:
    m = series_matrix()
    sep = "," if fmt.startswith("comma") else " \t "
    text = "\n".join(sep.join(f"{v:g}" for v in row) for row in m) + "\n"
    fname = f"{name}.csv" if fmt == "comma-csv" else f"{name}.txt"
    if fmt.endswith("gz"):
        (root / f"{fname}.gz").write_bytes(gzip.compress(text.encode()))
    else:
        (root / fname).write_text(text)


@pytest.mark.parametrize("name", ["electricity", "traffic"])
@pytest.mark.parametrize("fmt", ["comma", "comma-csv", "whitespace", "comma-gz", "whitespace-gz"])
def test_series_windows(tmp_path: Path, name: str, fmt: str) -> None:
    write_series(tmp_path, name, fmt)
    b = load(name=name, root=str(tmp_path), seq_len=WINDOW, horizon=HORIZON, normalize=False)
    m = torch.from_numpy(series_matrix())
    xtr, ytr = tensors(b.train)
    xte, yte = tensors(b.test)
    count = ROWS - WINDOW - HORIZON + 1  # 24 windows
    cut = count - round(count * 0.2)  # 19 train, 5 test, in time order
    assert (len(b.train), len(b.test)) == (cut, count - cut)
    assert b.task == "regression" and b.input_shape == (WINDOW, COLS) and b.output_dim == COLS
    assert b.num_classes is None and xtr.dtype == torch.float32 and ytr.dtype == torch.float32
    assert xtr.shape == (cut, WINDOW, COLS) and ytr.shape == (cut, COLS)
    i = 7
    assert torch.equal(xtr[i], m[i : i + WINDOW])  # rows i .. i+4
    # the target is the row `horizon` steps after the window's last row (i + WINDOW - 1)
    assert torch.equal(ytr[i], m[i + WINDOW - 1 + HORIZON])
    assert ytr[i, 0].item() == 10 * (i + 6)
    # chronological: test windows start right after the last training window
    assert torch.equal(xte[0], m[cut : cut + WINDOW]) and torch.equal(yte[-1], m[-1])
    assert xte[:, 0, 0].min() > xtr[:, 0, 0].max()


def test_series_subfolder_limits_and_one_window(tmp_path: Path) -> None:
    (tmp_path / "traffic").mkdir()
    write_series(tmp_path / "traffic", "traffic", "comma")
    b = load(name="traffic", root=str(tmp_path), seq_len=WINDOW, horizon=HORIZON, normalize=False,
             max_train=1, max_test=1)  # one window: a contiguous view, must still become a writable copy
    (x, y), (xt, _) = b.train[0], b.test[0]
    m = torch.from_numpy(series_matrix())
    assert torch.equal(x, m[:WINDOW]) and torch.equal(y, m[WINDOW + HORIZON - 1]) and torch.equal(xt, m[19:24])
    x.add_(1)
    assert torch.equal(b.train[0][0], m[:WINDOW] + 1)


def test_series_normalize_uses_training_rows(tmp_path: Path) -> None:
    write_series(tmp_path, "electricity", "comma")
    b = load(name="electricity", root=str(tmp_path), seq_len=WINDOW, horizon=HORIZON)
    m = series_matrix()
    seen = m[: 19 + WINDOW + HORIZON - 1]  # every row a training window or target touches
    xtr, _ = tensors(b.train)
    expected = (m[:WINDOW] - seen.mean(axis=0)) / (seen.std(axis=0) + 1e-8)
    np.testing.assert_allclose(xtr[0].numpy(), expected, rtol=1e-5, atol=1e-5)


def test_series_too_short_and_missing(tmp_path: Path) -> None:
    (tmp_path / "electricity.txt").write_text("1,2\n3,4\n5,6\n")
    with pytest.raises(ValueError, match="too few"):
        load(name="electricity", root=str(tmp_path), seq_len=2, horizon=1)
    with pytest.raises(DatasetNotFound) as err:
        load(name="traffic", root=str(tmp_path))
    assert str(tmp_path) in str(err.value) and "traffic.txt" in str(err.value)


# ------------------------------------------------------------------------------------------ PTB

PTB_TRAIN = " the cat sat on the mat \n the dog sat \n a cat ran on a mat \n the end \n"
PTB_TEST = " the zebra sat \n a cat flew away \n"


def write_ptb(root: Path, gz: bool = False) -> None:
    for split, text in [("train", PTB_TRAIN), ("valid", PTB_TEST), ("test", PTB_TEST)]:
        if gz:
            (root / f"ptb.{split}.txt.gz").write_bytes(gzip.compress(text.encode()))
        else:
            (root / f"ptb.{split}.txt").write_text(text)


@pytest.mark.parametrize("gz", [False, True])
def test_ptb(tmp_path: Path, gz: bool) -> None:
    write_ptb(tmp_path, gz)
    seq = 4
    b = load(name="ptb", root=str(tmp_path), seq_len=seq)
    words = sorted(set(PTB_TRAIN.split()) | {"<unk>", "<eos>"})
    vocab = {w: i for i, w in enumerate(words)}
    assert b.task == "lm" and b.num_classes == len(vocab) and b.input_shape == (seq,)
    train_tokens = [vocab[w] for line in PTB_TRAIN.splitlines() for w in [*line.split(), "<eos>"]]
    assert len(train_tokens) == 21  # 17 words + 4 <eos>
    xtr, ytr = tensors(b.train)
    n = (len(train_tokens) - 1) // seq
    assert xtr.shape == (n, seq) == ytr.shape and xtr.dtype == torch.int64
    assert xtr.flatten().tolist() == train_tokens[: n * seq]
    assert ytr.flatten().tolist() == train_tokens[1 : n * seq + 1]
    assert torch.equal(ytr[:, :-1], xtr[:, 1:])
    assert xtr[1, 2].item() == vocab["<eos>"]  # 'the cat sat on the mat <eos>': token 6 ends line 1
    xte, yte = tensors(b.test)
    test_words = ["the", "<unk>", "sat", "<eos>", "a", "cat", "<unk>", "<unk>", "<eos>"]  # zebra, flew, away
    assert xte.shape == (2, seq) and torch.equal(yte[:, :-1], xte[:, 1:])
    assert xte.flatten().tolist() + [yte[-1, -1].item()] == [vocab[w] for w in test_words]


def test_ptb_limits_short_and_missing(tmp_path: Path) -> None:
    write_ptb(tmp_path)
    b = load(name="ptb", root=str(tmp_path), seq_len=2, max_train=3, max_test=1)
    assert len(b.train) == 3 and len(b.test) == 1
    with pytest.raises(ValueError, match="too few"):
        load(name="ptb", root=str(tmp_path), seq_len=9)  # 9 test tokens cannot give one chunk of 9 + 1
    (tmp_path / "ptb.test.txt").unlink()
    with pytest.raises(DatasetNotFound) as err:
        load(name="ptb", root=str(tmp_path))
    assert str(tmp_path) in str(err.value) and "ptb.test.txt" in str(err.value)


def test_ptb_subfolder(tmp_path: Path) -> None:
    (tmp_path / "ptb").mkdir()
    write_ptb(tmp_path / "ptb")
    assert load(name="ptb", root=str(tmp_path), seq_len=4).num_classes == len(set(PTB_TRAIN.split())) + 2


# ------------------------------------------------------------------------------------------ npz


def test_npz_integer_labels_classify(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "d.npz"
    y = np.repeat(np.array([0, 2, 6]), 10)
    np.savez(path, X=rng.standard_normal((30, 4)), y=y)
    b = load(name="npz", path=str(path), normalize=False)
    xtr, ytr = tensors(b.train)
    xte, yte = tensors(b.test)
    assert b.task == "classification" and b.num_classes == 7 and b.input_shape == (4,)
    assert xtr.dtype == torch.float32 and ytr.dtype == torch.int64
    assert len(b.train) + len(b.test) == 30 and set(yte.tolist()) == {0, 2, 6}


@pytest.mark.parametrize("shape", [(40,), (40, 1), (40, 3)])
def test_npz_float_targets_regress(tmp_path: Path, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "r.npz"
    x = rng.standard_normal((40, 5))
    y = rng.standard_normal(shape)
    np.savez(path, X=x, y=y)
    b = load(name="npz", path=str(path), normalize=False)
    k = 1 if len(shape) == 1 else shape[1]
    xtr, ytr = tensors(b.train)
    assert b.task == "regression" and b.output_dim == k and b.num_classes is None
    assert ytr.shape == (len(b.train), k) and ytr.dtype == torch.float32 and xtr.dtype == torch.float32
    assert len(b.train) == 32 and len(b.test) == 8
    # rows stay paired: each training x finds its own y
    for xi, yi in zip(xtr, ytr, strict=True):
        row = int(np.flatnonzero(np.isclose(x[:, 0], xi[0].item(), atol=1e-6))[0])
        np.testing.assert_allclose(yi.numpy(), y[row].reshape(-1).astype(np.float32), rtol=1e-6)


def test_npz_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.npz"
    with pytest.raises(DatasetNotFound) as err:
        load(name="npz", path=str(missing))
    assert str(missing) in str(err.value) and "dataset.path" in str(err.value)
    bad = tmp_path / "bad.npz"
    np.savez(bad, X=np.zeros((4, 2)), labels=np.zeros(4))
    with pytest.raises(ValueError, match="needs X and y") as verr:
        load(name="npz", path=str(bad))
    assert str(bad) in str(verr.value) and "labels" in str(verr.value)
    np.savez(bad, y=np.zeros(4))
    with pytest.raises(ValueError, match="needs X and y"):
        load(name="npz", path=str(bad))
    np.savez(bad, X=np.zeros((4, 2)), y=np.zeros(3))
    with pytest.raises(ValueError, match="4 rows but y has 3"):
        load(name="npz", path=str(bad))


# -------------------------------------------------------------------------------- digits, synthetic


def test_digits_sizes_and_stratified_split() -> None:
    b = load(name="digits")
    xtr, ytr = tensors(b.train)
    xte, yte = tensors(b.test)
    assert len(b.train) + len(b.test) == 1797 and 0.18 < len(b.test) / 1797 < 0.22
    assert xtr.shape[1:] == (1, 8, 8) and b.input_shape == (1, 8, 8) and b.num_classes == 10
    assert set(yte.tolist()) == set(range(10)) and set(ytr.tolist()) == set(range(10))
    raw = load(name="digits", normalize=False)
    assert float(tensors(raw.train)[0].max()) == 1.0 and float(tensors(raw.train)[0].min()) == 0.0


def test_synthetic_sizes_and_classes() -> None:
    b = load(name="synthetic")
    assert (len(b.train), len(b.test)) == (410, 102)
    assert b.input_shape == (20,) and b.num_classes == 4
    assert set(tensors(b.test)[1].tolist()) == set(range(4))


@pytest.mark.parametrize("name", ["digits", "synthetic"])
def test_seeded_determinism(name: str) -> None:
    a, same, other = load(seed=3, name=name), load(seed=3, name=name), load(seed=4, name=name)
    for part in ("train", "test"):
        for t1, t2 in zip(tensors(getattr(a, part)), tensors(getattr(same, part)), strict=True):
            assert torch.equal(t1, t2)
    assert not torch.equal(tensors(a.test)[0][: len(other.test)], tensors(other.test)[0][: len(a.test)])


def test_digits_are_scikit_learns_digits_read_without_importing_it() -> None:
    from sklearn.datasets import load_digits as sk_digits

    from api_schemas.spec import DatasetSpec
    from workers.train.datasets import digits_file

    table = np.loadtxt(digits_file(), delimiter=",")
    x, y = sk_digits(return_X_y=True)
    assert np.array_equal(table[:, :-1], x) and np.array_equal(table[:, -1].astype(np.int64), y)
    bundle = load_dataset(DatasetSpec(name="digits"), seed=0)
    assert len(bundle.train) + len(bundle.test) == len(x) == 1797
