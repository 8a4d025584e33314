"""Models: shapes per model/task, all weight matrices in Linear/Conv, causality, training, clear errors."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from api_schemas.spec import CNNModel, MLPModel, ResNetModel, TransformerModel
from workers.train.models import MLP, build_model, build_model_for, loss_fn_for

ALLOWED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.Embedding)
TELEPORTABLE = (nn.Linear, nn.Conv1d, nn.Conv2d)

SMALL_TF = TransformerModel(heads=2, head_dim=4, layers=2, max_len=32)

# (name, spec, task, input_shape, num_classes, output_dim, expected output shape per sample)
CASES = [
    ("mlp-cls", MLPModel(hidden=[16, 8]), "classification", (64,), 10, None, (10,)),
    ("mlp-img", MLPModel(hidden=[16]), "classification", (1, 8, 8), 10, None, (10,)),
    ("mlp-reg", MLPModel(hidden=[16], activation="tanh"), "regression", (6, 3), None, 3, (3,)),
    ("mlp-leaky", MLPModel(hidden=[8], activation="leaky_relu"), "classification", (5,), 3, None, (3,)),
    ("mlp-gelu", MLPModel(hidden=[8], activation="gelu", bias=False), "classification", (5,), 3, None, (3,)),
    ("cnn-digits", CNNModel(channels=[4, 8]), "classification", (1, 8, 8), 10, None, (10,)),
    ("cnn-digits-deep", CNNModel(channels=[2, 2, 2, 2, 2]), "classification", (1, 8, 8), 10, None, (10,)),
    ("cnn-cifar", CNNModel(channels=[4, 8, 8]), "classification", (3, 32, 32), 100, None, (100,)),
    ("cnn-nopool", CNNModel(channels=[4], pool=False, kernel_size=5), "regression", (2, 6, 6), None, 2, (2,)),
    ("cnn-even-k", CNNModel(channels=[4, 4], kernel_size=2), "classification", (1, 5, 5), 3, None, (3,)),
    ("resnet", ResNetModel(channels=[4, 4, 4, 8, 8, 8]), "classification", (3, 16, 16), 7, None, (7,)),
    ("resnet-bn", ResNetModel(channels=[4, 8, 8, 8, 16], batch_norm=True), "classification", (3, 16, 16), 5,
     None, (5,)),
    ("resnet-tiny", ResNetModel(channels=[4, 8, 16, 32]), "classification", (3, 2, 2), 3, None, (3,)),
    ("tf-cls", SMALL_TF, "classification", (12, 1), 10, None, (10,)),
    ("tf-reg", SMALL_TF, "regression", (10, 5), None, 5, (5,)),
    ("tf-reg-mean", SMALL_TF.model_copy(update={"pooling": "mean"}), "regression", (10, 5), None, 5, (5,)),
    ("tf-cls-last", SMALL_TF.model_copy(update={"pooling": "last"}), "classification", (8, 3), 4, None, (4,)),
    ("tf-lm", SMALL_TF, "lm", (16,), 50, None, (16, 50)),
]


def _inputs(task: str, shape: tuple[int, ...], vocab: int | None, batch: int = 3, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    if task == "lm":
        assert vocab is not None
        return torch.randint(0, vocab, (batch, *shape), generator=g)
    return torch.randn(batch, *shape, generator=g)


def _targets(task: str, out_shape: tuple[int, ...], batch: int = 3, seed: int = 1) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    if task == "classification":
        return torch.randint(0, out_shape[0], (batch,), generator=g)
    if task == "lm":
        return torch.randint(0, out_shape[-1], (batch, out_shape[0]), generator=g)
    return torch.randn(batch, *out_shape, generator=g)


ARGS = ("name", "spec", "task", "shape", "ncls", "odim", "out")
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize(ARGS, CASES, ids=IDS)
def test_forward_shapes(name: str, spec: Any, task: str, shape: Any, ncls: Any, odim: Any, out: Any) -> None:
    torch.manual_seed(0)
    model = build_model(spec, task=task, input_shape=shape, num_classes=ncls, output_dim=odim)
    y = model(_inputs(task, shape, ncls))
    assert y.shape == (3, *out)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize(ARGS, CASES, ids=IDS)
def test_weights_live_in_linear_and_conv(name: str, spec: Any, task: str, shape: Any, ncls: Any, odim: Any,
                                         out: Any) -> None:
    model = build_model(spec, task=task, input_shape=shape, num_classes=ncls, output_dim=odim)
    teleportable = 0
    for mod_name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own:
            continue
        assert isinstance(module, ALLOWED), f"{mod_name} ({type(module).__name__}) holds raw parameters"
        if isinstance(module, TELEPORTABLE):
            teleportable += 1
        elif not isinstance(module, nn.Embedding):
            assert all(p.dim() == 1 for p in own), f"{mod_name}: a weight matrix outside Linear/Conv"
    assert teleportable >= 2
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())


def test_transformer_attention_is_four_linears() -> None:
    model = build_model(SMALL_TF, task="classification", input_shape=(5, 2), num_classes=3, output_dim=None)
    attn = model.blocks[0].attn  # type: ignore[index]
    assert all(isinstance(getattr(attn, n), nn.Linear) for n in "qkvo")
    assert attn.q.weight.shape == (8, 8)


def test_default_resnet_runs_on_tiny_imagenet_shapes() -> None:
    model = build_model(ResNetModel(), task="classification", input_shape=(3, 64, 64), num_classes=200,
                        output_dim=None)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [64, 64, 64, 128, 128, 128, 256, 256, 256]
    assert sum(1 for c in convs if c.stride == (2, 2)) == 2  # downsampling by stride, not pooling
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 200)
        small = build_model(ResNetModel(), task="classification", input_shape=(3, 16, 16), num_classes=200,
                            output_dim=None)
        assert small(torch.randn(2, 3, 16, 16)).shape == (2, 200)


def test_default_cnn_is_the_papers_cifar_net() -> None:
    model = build_model(CNNModel(), task="classification", input_shape=(3, 32, 32), num_classes=10,
                        output_dim=None)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels) for c in convs] == [(3, 16), (16, 32), (32, 64)]
    assert sum(isinstance(m, nn.MaxPool2d) for m in model.modules()) == 3
    assert model.head.in_features == 64 * 4 * 4  # type: ignore[union-attr]


def test_causal_lm_does_not_look_ahead() -> None:
    torch.manual_seed(0)
    model = build_model(SMALL_TF, task="lm", input_shape=(12,), num_classes=30, output_dim=None).eval()
    tokens = torch.randint(0, 30, (2, 12))
    changed = tokens.clone()
    t = 7
    changed[:, t] = (changed[:, t] + 1) % 30
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :t], b[:, :t], atol=1e-6)
    assert not torch.allclose(a[:, t], b[:, t])


def test_lm_shorter_sequence_and_max_len_at_forward() -> None:
    model = build_model(SMALL_TF, task="lm", input_shape=(16,), num_classes=20, output_dim=None)
    assert model(torch.randint(0, 20, (2, 5))).shape == (2, 5, 20)
    with pytest.raises(ValueError, match="model.max_len"):
        model(torch.randint(0, 20, (1, 33)))


def test_mlp_exposes_layers_and_slope() -> None:
    model = build_model(MLPModel(hidden=[6, 5], activation="leaky_relu", negative_slope=0.2),
                        task="classification", input_shape=(1, 2, 2), num_classes=3, output_dim=None)
    assert isinstance(model, MLP)
    assert [(m.in_features, m.out_features) for m in model.layers] == [(4, 6), (6, 5), (5, 3)]
    assert model.negative_slope == pytest.approx(0.2)
    x = torch.randn(4, 1, 2, 2)
    h = x.flatten(1)
    for layer in model.layers[:-1]:
        h = F.leaky_relu(layer(h), 0.2)
    assert torch.allclose(model(x), model.layers[-1](h))  # forward = flatten -> (linear, act)* -> linear
    relu = build_model(MLPModel(hidden=[4]), task="classification", input_shape=(3,), num_classes=2,
                       output_dim=None)
    assert relu.negative_slope is None  # type: ignore[union-attr]


TRAINED = {"mlp-cls", "cnn-digits", "resnet-bn", "tf-cls", "tf-reg", "tf-lm"}
TRAIN_CASES = [c for c in CASES if c[0] in TRAINED]


@pytest.mark.parametrize(ARGS, TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_a_few_steps_lower_the_loss(name: str, spec: Any, task: str, shape: Any, ncls: Any, odim: Any,
                                    out: Any) -> None:
    torch.manual_seed(0)
    model = build_model(spec, task=task, input_shape=shape, num_classes=ncls, output_dim=odim).double()
    x = _inputs(task, shape, ncls, batch=8)
    x = x if task == "lm" else x.double()
    y = _targets(task, out, batch=8)
    y = y.double() if task == "regression" else y
    loss_fn = loss_fn_for(task)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = loss_fn(model(x), y).item()
    for _ in range(10):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    assert loss_fn(model(x), y).item() < 0.9 * first


def test_loss_functions() -> None:
    logits = torch.randn(4, 5)
    target = torch.tensor([0, 1, 2, 3])
    assert torch.allclose(loss_fn_for("classification")(logits, target), F.cross_entropy(logits, target))
    pred, goal = torch.randn(4, 1), torch.randn(4)
    assert torch.allclose(loss_fn_for("regression")(pred, goal), F.mse_loss(pred.squeeze(1), goal))
    lm_logits, lm_target = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    want = F.cross_entropy(lm_logits.reshape(6, 7), lm_target.reshape(6))
    assert torch.allclose(loss_fn_for("lm")(lm_logits, lm_target), want)
    with pytest.raises(ValueError, match="unknown task"):
        loss_fn_for("ranking")


def test_build_model_for_reads_the_bundle() -> None:
    data = SimpleNamespace(task="classification", input_shape=(1, 8, 8), num_classes=10, output_dim=None,
                           name="digits")
    model = build_model_for(CNNModel(channels=[4]), data)  # type: ignore[arg-type]
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    flat = SimpleNamespace(task="classification", input_shape=(20,), num_classes=3, output_dim=None,
                           name="npz")
    needle = r"model.kind=cnn needs image input \(C,H,W\); dataset npz gives \(20,\): use model.kind=mlp"
    with pytest.raises(ValueError, match=needle):
        build_model_for(CNNModel(), flat)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "task", "shape", "ncls", "odim", "needle"),
    [
        (CNNModel(), "classification", (20,), 3, None, "use model.kind=mlp"),
        (ResNetModel(), "classification", (784, 1), 10, None, "use model.kind=transformer"),
        (CNNModel(), "lm", (16,), 100, None, "use model.kind=transformer"),
        (MLPModel(), "lm", (16,), 100, None, "use model.kind=transformer"),
        (TransformerModel(), "classification", (1, 8, 8), 10, None, "use model.kind=cnn"),
        (TransformerModel(), "classification", (64,), 10, None, "transformer needs sequence input"),
        (TransformerModel(max_len=100), "classification", (784, 1), 10, None, "model.max_len"),
        (TransformerModel(max_len=8), "lm", (16,), 50, None, "model.max_len"),
        (TransformerModel(pooling="mean"), "lm", (16,), 50, None, "model.pooling"),
        (TransformerModel(pooling="none"), "regression", (16, 3), None, 3, "model.pooling"),
        (MLPModel(), "classification", (5,), None, None, "num_classes"),
        (MLPModel(), "regression", (5,), None, None, "output_dim"),
        (MLPModel(), "ranking", (5,), 3, None, "unknown task"),
    ],
)
def test_errors_name_the_field(spec: Any, task: str, shape: Any, ncls: Any, odim: Any, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        build_model(spec, task=task, input_shape=shape, num_classes=ncls, output_dim=odim)


@pytest.mark.parametrize(ARGS, TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_teleport_reaches_every_linear_and_conv(name: str, spec: Any, task: str, shape: Any, ncls: Any,
                                                odim: Any, out: Any) -> None:
    from teleport import TeleportConfig, teleport_batch

    torch.manual_seed(0)
    model = build_model(spec, task=task, input_shape=shape, num_classes=ncls, output_dim=odim).double()
    x = _inputs(task, shape, ncls, batch=4)
    x = x if task == "lm" else x.double()
    y = _targets(task, out, batch=4)
    y = y.double() if task == "regression" else y
    report = teleport_batch(model, loss_fn_for(task), x, y, TeleportConfig(steps=2, lr=0.05, tau=1.0))
    owners = {n: type(m) for n, m in model.named_modules()}
    for pname in report.untouched:  # only norms and embedding tables may be left out
        owner = owners[pname.rsplit(".", 1)[0]]
        assert issubclass(owner, (nn.LayerNorm, nn.BatchNorm2d, nn.Embedding)), pname
    assert report.grad_norm_sq_after >= report.grad_norm_sq_before
    assert abs(report.loss_after - report.loss_before) <= 1e-2 * abs(report.loss_before)


# the paper's data shapes: (task, per-sample input shape, num_classes or vocab, output_dim)
PAPER_SHAPES: dict[str, tuple[str, tuple[int, ...], int | None, int | None]] = {
    "mnist": ("classification", (1, 28, 28), 10, None),
    "cifar100": ("classification", (3, 32, 32), 100, None),
    "tiny_imagenet": ("classification", (3, 64, 64), 200, None),
    "smnist": ("classification", (784, 1), 10, None),
    "electricity": ("regression", (168, 321), None, 321),
    "ptb": ("lm", (256,), 10_000, None),
}


@pytest.mark.parametrize("dataset", sorted(PAPER_SHAPES))
def test_paper_presets_build_on_the_papers_shapes(dataset: str) -> None:
    from api_schemas import load_spec

    task, shape, ncls, odim = PAPER_SHAPES[dataset]
    spec = load_spec(f"paper/{dataset}-adam")
    model = build_model(spec.model, task=task, input_shape=shape, num_classes=ncls, output_dim=odim)
    with torch.no_grad():
        y = model(_inputs(task, shape, ncls, batch=1))
    assert y.shape == ((1, shape[0], ncls) if task == "lm" else (1, ncls or odim))
