"""A teleport split across real gloo ranks: identical replicas, and the single-process result."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from teleport import TeleportConfig, teleport_batch
from teleport.distributed import TorchDistributed

CONFIG = TeleportConfig(steps=4, lr=0.3, cap=1e6, tau=1.0, loss_tol=1e-6)


class TiedAttentionLM(nn.Module):
    """Token embedding tied to the LM head, and an nn.MultiheadAttention block (packed Q/K/V)."""

    def __init__(self, vocab: int = 24, d: int = 16) -> None:
        super().__init__()
        self.wte, self.pre = nn.Embedding(vocab, d), nn.Linear(d, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.pre(self.wte(tokens)))  # (B, T, d)
        a, _ = self.attn(h, h, h, need_weights=False)
        return F.linear(torch.tanh(h + a), self.wte.weight)  # (B, T, V)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def loss_for(kind: str):  # noqa: ANN201 - a loss function
    return lm_loss if kind == "lm" else F.cross_entropy


def build(kind: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "lm":  # 5 samples × 3 tokens = 15 columns < 17 inputs of every projection
        tokens = torch.randint(0, 12, (5, 3))  # rows 12.. of the table are never looked up: free to move
        return TiedAttentionLM().double(), tokens, tokens
    if kind == "mlp":  # 10 samples < 33 inputs: the thin-SVD route (columns all-gathered)
        model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        return model.double(), torch.randn(10, 12, dtype=torch.float64), torch.randint(0, 4, (10,))
    model = nn.Sequential(  # conv columns ≫ rows: the Gram route (Gram matrices all-reduced)
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 6 * 6, 3),
    )
    return model.double(), torch.randn(9, 2, 6, 6, dtype=torch.float64), torch.randint(0, 3, (9,))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(tau: float) -> TeleportConfig:
    return TeleportConfig(**{**CONFIG.__dict__, "tau": tau, "loss_tol": 1e-6 if tau == 1.0 else 0.05})


def _rank_main(rank: int, world: int, port: int, kind: str, tau: float, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, x, y = build(kind)
        shards = torch.tensor_split(torch.arange(x.shape[0]), world)  # unequal shards on purpose
        idx = shards[rank]
        report = teleport_batch(model, loss_for(kind), x[idx], y[idx], config(tau), comm=TorchDistributed())
        torch.save({"state": model.state_dict(), "report": report.to_dict()}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "tau"), [("mlp", 1.0), ("cnn", 0.95), ("lm", 1.0)])
def test_distributed_teleport_matches_single_process_and_keeps_replicas_identical(
    kind: str, tau: float, tmp_path: Path
) -> None:
    world = 3
    mp.start_processes(_rank_main, args=(world, _free_port(), kind, tau, str(tmp_path)), nprocs=world,
                       start_method="spawn")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for other in results[1:]:  # bit-identical replicas
        for name, value in results[0]["state"].items():
            assert torch.equal(value, other["state"][name]), name
        assert other["report"]["loss_after"] == results[0]["report"]["loss_after"]

    model, x, y = build(kind)
    table = model.wte.weight.detach().clone() if kind == "lm" else None
    single = teleport_batch(model, loss_for(kind), x, y, config(tau))
    dist_report = results[0]["report"]
    assert dist_report["steps"] == single.steps > 0
    assert dist_report["loss_before"] == pytest.approx(single.loss_before, rel=1e-12)
    assert dist_report["grad_norm_sq_after"] == pytest.approx(single.grad_norm_sq_after, rel=1e-8)
    assert [lr["rank"] for lr in dist_report["layers"]] == [lr.rank for lr in single.layers]
    if tau == 1.0:
        assert abs(dist_report["loss_after"] - dist_report["loss_before"]) <= 1e-6 * dist_report["loss_before"]
    for name, value in model.state_dict().items():
        assert torch.allclose(results[0]["state"][name], value, atol=1e-9), name
    if table is not None:  # rows looked up on any rank stay fixed on every rank; the others moved
        looked_up = torch.unique(x)
        state = results[0]["state"]["wte.weight"]
        assert torch.equal(state[looked_up], table[looked_up])
        assert (state[12:] - table[12:]).norm() > 0
        assert {"attn.in_proj_weight", "attn.out_proj"} <= {lr["name"] for lr in dist_report["layers"]}
