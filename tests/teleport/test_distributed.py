"""A teleport split across real gloo ranks: identical replicas, exact, and the single-process result.

One process group of 3 gloo ranks, started once for the module (a start costs seconds), runs:
every case of ``families`` (the models ``test_uses`` teleports) on the subgroup of ranks {1, 2}, whose
group ranks are not its global ones; three models with unequal shards on all 3 ranks; and a batch of
2 samples over 3 ranks, which must fail on every rank alike. The tests then read what each rank saved.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from teleport import TeleportConfig, teleport_batch
from teleport.distributed import TorchDistributed
from tests.teleport.families import CASES, OPEN, Case, lm_loss

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("float64")]
WORLD, PAIR = 3, [1, 2]
CONFIG = TeleportConfig(steps=4, lr=0.3, cap=1e6, tau=1.0, loss_tol=1e-6)
GLOO_TIMEOUT_S = 90  # a rank left waiting in a collective fails after this, rather than hanging
DEADLINE_S = 240  # the whole group


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


def lm() -> Case:  # 5 samples × 3 tokens = 15 columns < 17 inputs of every projection
    torch.manual_seed(0)
    tokens = torch.randint(0, 12, (5, 3))  # rows 12.. of the table are never looked up: free to move
    return Case(TiedAttentionLM(), tokens, tokens, ["wte.weight", "attn.in_proj_weight"], lm_loss)


def mlp(n: int = 10) -> Case:  # 10 samples < 33 inputs: the thin-SVD route (columns all-gathered)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    return Case(model, torch.randn(n, 12), torch.randint(0, 4, (n,)), ["2.weight", "4.weight"])


def cnn() -> Case:  # conv columns ≫ rows: the Gram route (Gram matrices all-reduced)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 6 * 6, 3),
    )
    return Case(model, torch.randn(9, 2, 6, 6), torch.randint(0, 3, (9,)), ["2.weight", "5.weight"])


# name -> (builder, config, ranks it runs on): the 3-rank cases first, so rank 0 is not left waiting
PLAN: dict[str, tuple[Callable[[], Case], TeleportConfig, list[int]]] = {
    "empty_shard": (lambda: mlp(2), CONFIG, [0, 1, 2]),  # tensor_split(2 samples, 3): rank 2 gets none
    "mlp": (mlp, CONFIG, [0, 1, 2]),
    "cnn_tau_0.95": (cnn, TeleportConfig(**{**CONFIG.__dict__, "tau": 0.95, "loss_tol": 0.05}), [0, 1, 2]),
    "lm": (lm, CONFIG, [0, 1, 2]),
    "mlp_difference": (mlp, replace(CONFIG, hvp="difference"), [0, 1, 2]),  # H·∇L from all-reduced gradients
    "lm_difference": (lm, replace(CONFIG, hvp="difference"), [0, 1, 2]),
} | {name: (make, OPEN, PAIR) for name, make in CASES.items()}
# a difference of gradients divides their rounding by ε: the ranks' summation order shows more than in the exact
# path, so these compare the move with the single process's (relative), not each weight to 1e-9
AGREE = {"mlp_difference": 1e-6, "lm_difference": 1e-6}


def _teleport_shard(make: Callable[[], Case], config: TeleportConfig, comm: TorchDistributed) -> dict[str, Any]:
    case = make()
    idx = torch.tensor_split(torch.arange(case.x.shape[0]), comm.world_size)[comm.rank]  # unequal shards
    try:
        report = teleport_batch(case.model, case.loss_fn, case.x[idx], case.y[idx], config, comm=comm)
    except ValueError as e:
        return {"error": str(e)}
    return {"state": case.model.state_dict(), "report": report.to_dict()}


def _rank_main(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)  # 3 ranks on a 2-core machine
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    try:
        pair = dist.new_group(PAIR)  # every rank calls it, members or not
        comms = {WORLD: TorchDistributed(), len(PAIR): TorchDistributed(pair) if rank in PAIR else None}
        results = {name: _teleport_shard(make, config, comms[len(members)])
                   for name, (make, config, members) in PLAN.items() if rank in members}
        torch.save(results, f"{out}/rank{rank}.pt")
        dist.barrier()  # rank 0 hosts the store: it stays until the pair is done
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What every rank returned for every case of PLAN (one group start for the module)."""
    out = tmp_path_factory.mktemp("ranks")
    ctx = mp.start_processes(_rank_main, args=(_free_port(), str(out)), nprocs=WORLD, start_method="spawn",
                             join=False)
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"the process group did not finish in {DEADLINE_S} s: a rank hangs")
    finally:
        for p in ctx.processes:  # only after a failure: our own rank processes
            if p.is_alive():
                p.kill()
    return [torch.load(Path(out) / f"rank{r}.pt") for r in range(WORLD)]


def _loss(case: Case) -> float:
    with torch.no_grad():
        return float(case.loss_fn(case.model(case.x), case.y))


@pytest.mark.parametrize("name", [n for n in PLAN if n != "empty_shard"])
def test_every_rank_ends_identical_exact_and_as_one_process(name: str, ranks: list[dict[str, Any]]) -> None:
    make, config, members = PLAN[name]
    results = [ranks[r][name] for r in members]
    state, report = results[0]["state"], results[0]["report"]
    for other in results[1:]:  # bit-identical replicas, the same report (but for its own clock)
        for key, value in state.items():
            assert torch.equal(value, other["state"][key]), key
        assert {**other["report"], "seconds": 0} == {**report, "seconds": 0}

    case = make()
    before, loss0 = {k: v.clone() for k, v in case.model.state_dict().items()}, _loss(case)
    case.model.load_state_dict(state)
    for key in case.moved:
        assert (state[key] - before[key]).norm() > 0, f"{key} did not move"
    assert report["steps"] > 0 and report["grad_norm_sq_after"] > report["grad_norm_sq_before"]
    if config.tau == 1.0:  # exact: the loss on the whole batch (every rank's shard) is kept
        assert abs(_loss(case) - loss0) <= 1e-9 * abs(loss0)

    single = make()  # the same objective as the whole batch in one process: the same teleport
    one = teleport_batch(single.model, single.loss_fn, single.x, single.y, config)
    assert report["steps"] == one.steps and report["backoffs"] == one.backoffs
    assert report["loss_before"] == pytest.approx(one.loss_before, rel=1e-12)
    assert report["grad_norm_sq_after"] == pytest.approx(one.grad_norm_sq_after, rel=max(1e-8, AGREE.get(name, 0)))
    assert [lr["rank"] for lr in report["layers"]] == [lr.rank for lr in one.layers]
    assert report["untouched"] == one.untouched and report["hvp"] == one.hvp == config.hvp
    alone = single.model.state_dict()
    if name in AGREE:
        off = sum(float((state[k] - v).square().sum()) for k, v in alone.items())
        moved = sum(float((v - before[k]).square().sum()) for k, v in alone.items())
        assert (off / moved) ** 0.5 <= AGREE[name], (off / moved) ** 0.5
        return
    for key, value in alone.items():
        assert torch.allclose(state[key], value, rtol=0, atol=1e-9), key


def test_rows_looked_up_on_any_rank_stay_fixed_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    case = lm()
    table, state = case.model.wte.weight.detach(), ranks[0]["lm"]["state"]["wte.weight"]
    looked_up = torch.unique(case.x)  # each rank looks up only its own shard's tokens
    assert torch.equal(state[looked_up], table[looked_up])
    assert (state[12:] - table[12:]).norm() > 0
    assert {"attn.in_proj_weight", "attn.out_proj"} <= {lr["name"] for lr in ranks[0]["lm"]["report"]["layers"]}


def test_an_empty_shard_fails_on_every_rank_alike_and_the_group_goes_on(ranks: list[dict[str, Any]]) -> None:
    errors = [r["empty_shard"].get("error") for r in ranks]
    assert errors[0] is not None and errors == [errors[0]] * WORLD, errors
    assert "\n" not in errors[0] and "rank(s) [2] of 3" in errors[0] and "batch x" in errors[0]
    assert all("state" in r["mlp"] for r in ranks)  # the next collective on the same group still matched
