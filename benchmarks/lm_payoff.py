"""Does teleport pay on a language model? Its cost in training steps, and seconds to the baseline's loss.

Two parts, on the device given (``--device cpu|cuda``), side by side in one run:

1. **Cost of one teleport** on a GPT-style LM (d = 512, 4 pre-norm ``nn.TransformerEncoderLayer`` blocks,
   8 heads, FF 4d, context 128, a char vocabulary of 256, token embedding tied to the head; ``--quick``:
   d = 64, 2 blocks, context 32): a training step (AdamW, 32 sequences) against one teleport on 2
   sequences — with 8 ascent steps forced (CAP and loss_tol off: the most a teleport of 8 steps costs) and
   with the product's defaults (lr 0.2, CAP 5: where ‖∇L‖² already exceeds CAP no step is taken; decided by
   ``check_first``'s plain forward + backward, and, side by side, by the recorded evaluation without it). Per
   ascent step: kernel launches (the profiler's ``cudaLaunchKernel`` on CUDA; on the CPU the ops that run a
   kernel, as dispatched: no views, no allocations, backward ops included) and the
   teleport's host reads (its ``Teleporter``'s ``reads``), each as (T(8) − T(0)) / 8 — for each way of
   running the steps (``teleport.ascent``: the host guard, what ``auto`` runs, and the device ticks; on CUDA
   the ticks in a CUDA graph too, measured last) and each H·∇L (``teleport.hvp``: exact, difference); and
   where a batch's setup goes (``benchmarks.lm_setup``: the recorded evaluation, the bases, their eigh on the
   device and on the host).
2. **Payoff** on ``examples/tiny_lm`` (a char LM on Python source; ``benchmarks.lm_payoff_runs``): baseline
   against teleport with SGD and Adam, Adam teleporting before epoch 0 only (``adam_first``: what a run
   with Adam is told to do), and the way LMs are trained (``adamw_recipe``: AdamW, weight decay 0.1, 20 warm-up
   steps, a cosine to 0.1 × lr, gradients clipped to 1.0; teleport before epoch 0 only), through the product's
   own loop (``workers.train.loop.train``) with ``teleport.budget`` at its default: seconds to the baseline's
   final train loss as a ratio, and teleport's share of the run, for each of ``--seeds`` seeds (3; quick 1) and
   their median. ``--quick`` and the CPU default are small (CPU: d = 128, 2 layers, context 32, 6 epochs, 2
   teleport batches of 2 sequences, 64 token columns < d); ``--size gpu`` is the full size (d = 256, 4
   layers, context 64, batch 64, 12 epochs, teleport before epochs 0-4, 8 batches × 8 steps).

Floors (printed, not asserted): one teleport ≤ 0.5 training steps on the CPU, ≤ 5 on CUDA; host
reads per ascent step ≤ 1; on CUDA at the GPU size, teleport share ≤ 15 % and seconds to the baseline's loss
≤ 1.0x with Adam.

    python -m benchmarks.lm_payoff [--quick] [--device cpu|cuda] [--size cpu|gpu] [--seeds N] [--threads K]
                                   [--ascent auto|host|device|cuda_graph|fastest] [--hvp exact|difference|cheaper]
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from api_schemas.spec import SCALE_FREE
from benchmarks.common import add_machine_args, print_table, quiet_machine, verdict, write_result
from benchmarks.lm_payoff_runs import payoff
from benchmarks.lm_setup import setup_phases
from teleport import TeleportConfig, Teleporter
from teleport.ascent.choose import ascent_mode
from teleport.hvp.difference import ShiftScale
from teleport.hvp.objective import HostReads

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")  # a graph: one launch
ASCENTS = ("host", "device")  # ``TeleportConfig.ascent`` side by side; on CUDA "cuda_graph" too (auto's there)
FORCED = {"lr": 1e-6, "cap": 1e12, "loss_tol": 1e9}  # every step accepted: the most 8 steps can cost
# ``api_schemas.spec.SCALE_FREE``: a teleport that moves the LM (its ‖∇L‖² doubled, then it stops), its steps its own
MOVING = {**SCALE_FREE, "cap": math.inf}
BEFORE_LAUNCHES = 15268 / 8  # the earlier ascent's kernel launches per step on an H100 (the floor: 1/5 of it)


class GPT(nn.Module):
    """tokens (B, T) -> logits (B, T, V): pre-norm encoder blocks under a causal mask, tied head."""

    def __init__(self, vocab: int, d: int, layers: int, ctx: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.0, activation="gelu",
                                                                batch_first=True, norm_first=True)
                                     for _ in range(layers)])
        self.ln = nn.LayerNorm(d)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        h = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))  # (B, T, d)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return F.linear(self.ln(h), self.wte.weight)  # (B, T, V)


def lm_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Any, device: torch.device, repeats: int, warm: bool = True) -> tuple[float, Any]:
    if warm:
        fn()  # warm-up (kernels chosen, allocator warm)
    best, out = float("inf"), None
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best, out


class _Kernels(TorchDispatchMode):
    """Counts the ops that run a kernel, as dispatched below autograd (backward ops included): no view, no
    allocation, no composite op counted with its parts — the CPU's stand-in for CUDA's kernel launches."""

    FREE = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resolve_conj",
                      "resolve_neg", "lift_fresh", "set_", "_has_compatible_shallow_copy_type"})

    def __init__(self, inside: Any = None) -> None:
        """``inside``: () -> bool, whether a kernel now is one of an emulated graph's (``in_graph`` counts those)."""
        super().__init__()
        self.count = self.in_graph = 0
        self.inside = inside

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not func.is_view and func._schema.name.split("::")[-1] not in self.FREE:
            self.count += 1
            self.in_graph += bool(self.inside is not None and self.inside())
        return func(*args, **(kwargs or {}))


def _launches(fn: Any, device: torch.device, reads: HostReads) -> tuple[int, int]:
    """(kernel launches: the profiler's launch events on CUDA, ``_Kernels`` on the CPU; the host reads ``reads``
    counted meanwhile: the teleporter's whose teleport ``fn`` runs) of one call."""
    from torch.profiler import ProfilerActivity, profile

    before = reads.count
    if device.type != "cuda":
        with _Kernels() as kernels:
            fn()
        return kernels.count, reads.count - before
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    launches = sum(e.count for e in prof.key_averages() if e.key in LAUNCHES)
    return launches, reads.count - before


def teleport_cost(device: torch.device, quick: bool, repeats: int,
                  ascents: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The teleport's cost in training steps on the GPT-style LM, for each of ``ascents`` (default: ``ASCENTS``, and
    on CUDA the CUDA graph, last) with either H·∇L, and the product's own teleports (defaults, scale-free)."""
    ascents = ascents or ASCENTS + (("cuda_graph",) if device.type == "cuda" else ())
    d, layers, ctx = (64, 2, 32) if quick else (512, 4, 128)
    torch.manual_seed(0)
    model = GPT(256, d, layers, ctx).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, 256, (32, ctx), device=device)  # (B, T)
    tele = torch.randint(0, 256, (2, ctx), device=device)
    others = [torch.randint(0, 256, (2, ctx), device=device) for _ in range(3)]  # other tokens: other frozen rows

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        lm_loss(model(batch), batch).backward()
        opt.step()

    # every teleport of the model by one teleporter: what one teaches the next (the aim at CAP, the CUDA graph, a
    # batch at CAP, the eigh routes) is kept from call to call, as a training loop's teleports keep it
    teleporter = Teleporter(model, lm_loss)

    def teleport(steps: int, ascent: str = "auto", hvp: str = "exact", x: Tensor | None = None, **kw: float) -> Any:
        config = TeleportConfig(steps=steps, ascent=ascent, hvp=hvp, **kw)
        x = tele if x is None else x
        return teleporter.teleport(x, x, config=config)

    def forced_cost(ascent: str, hvp: str = "exact") -> dict[str, Any]:
        fresh()  # every row from the same weights: a teleport moves them, and FORCED's steps double ‖∇L‖² and more
        forced_s, forced = _timed(lambda: teleport(8, ascent, hvp, **FORCED), device, repeats)
        zero_s, _ = _timed(lambda: teleport(0, ascent, hvp, **FORCED), device, repeats)  # evaluation and bases
        (l0, r0), (l8, r8) = (_launches(lambda t=t: teleport(t, ascent, hvp, **FORCED), device, teleporter.reads)
                              for t in (0, 8))
        row = {"ran_as": forced.ascent, "teleport_8_steps_s": forced_s,
               "teleport_8_steps_in_train_steps": forced_s / step_s,
               "forced_steps_taken": forced.steps, "forced_drift": abs(forced.loss_after - forced.loss_before),
               "launches_per_teleport_setup": l0, "launches_per_step": (l8 - l0) / 8,
               "host_reads_per_step": (r8 - r0) / 8,
               "phases_in_train_steps": {"evaluation_and_bases": zero_s / step_s,
                                         "ascent": (forced_s - zero_s) / step_s}}
        if ascent == "cuda_graph":  # a new batch each call, as in training: the graph serves it if its shapes hold
            turn = itertools.cycle(others)
            new_s, last = _timed(lambda: teleport(8, ascent, hvp, x=next(turn), **FORCED), device, repeats)
            row |= {"teleport_8_steps_new_batch_s": new_s, "teleport_8_steps_new_batch_in_train_steps": new_s / step_s,
                    "graph_replayed": forced.graph_replayed, "new_batch_graph_replayed": last.graph_replayed}
            # the teleport that moves the LM, a new batch each call (each its own CAP: the graph replays for it)
            moving_s, moving = _timed(lambda: teleport(8, ascent, hvp, x=next(turn), **MOVING), device, repeats)
            row |= {"scale_free_new_batch_in_train_steps": moving_s / step_s, "scale_free_steps": moving.steps,
                    "scale_free_graph_replayed": moving.graph_replayed}
        return row

    step_s, _ = _timed(train_step, device, repeats)
    start = {k: v.clone() for k, v in model.state_dict().items()}

    def fresh() -> None:
        model.load_state_dict(start)  # in place: the parameters keep their storages (a captured graph's key)
    by_ascent: dict[str, dict[str, Any]] = {}
    by_difference: dict[str, dict[str, Any]] = {}
    for ascent in ascents:  # side by side: the forced 8 steps in each way of running them, with either H·∇L
        for hvp, rows in (("exact", by_ascent), ("difference", by_difference)):
            try:
                rows[ascent] = forced_cost(ascent, hvp)
            except Exception as err:  # one way failing (a capture on an untried GPU) must not lose the others'
                rows[ascent] = {"error": f"{type(err).__name__}: {err}"[:300]}
    fresh()
    difference = {"direction_cosine": cosine(*directions(model, lm_loss, tele)), "by_ascent": by_difference}
    default_s, default = _timed(lambda: teleport(8), device, repeats)  # at CAP: decided by check_first's plain pass
    unchecked_s, _ = _timed(lambda: teleport(8, check_first=False), device, repeats)  # by the recorded evaluation
    default_launches = [_launches(lambda c=c: teleport(8, check_first=c), device, teleporter.reads)[0]
                        for c in (True, False)]
    # the product's defaults take no step here (‖∇L‖² over CAP): a teleport that moves the model, its steps its own
    # (each call starts where the last left the batch: ×2 each time, the same steps a call)
    free_s, free = _timed(lambda: teleport(8, **MOVING), device, repeats)
    fresh()  # the setup of the weights every row started from (a sharpened model's R may need eigenvalues)
    setup = setup_phases(model, lm_loss, tele, step_s, lambda fn: _timed(fn, device, repeats), teleporter.routes)
    return {
        "model": {"d": d, "layers": layers, "context": ctx, "vocab": 256, "train_batch": 32, "teleport_batch": 2},
        "train_step_s": step_s, "teleport_default_s": default_s, "teleport_default_in_train_steps": default_s / step_s,
        "default_steps_taken": default.steps, "default_stop_reason": default.stop_reason,
        "default_ascent": default.ascent, "default_launches": default_launches[0],
        "teleport_default_unchecked_s": unchecked_s, "teleport_default_unchecked_in_train_steps": unchecked_s / step_s,
        "default_unchecked_launches": default_launches[1], "by_ascent": by_ascent, "hvp_difference": difference,
        "teleport_scale_free_s": free_s, "teleport_scale_free_in_train_steps": free_s / step_s,
        "scale_free_steps_taken": free.steps, "scale_free_stop_reason": free.stop_reason,
        "scale_free_gain": free.grad_norm_sq_after / free.grad_norm_sq_before,
        "setup_phases": setup,
    } | {k: by_ascent[ascents[0]].get(k) for k in ("teleport_8_steps_s", "teleport_8_steps_in_train_steps",
                                                    "forced_drift", "launches_per_step", "host_reads_per_step")}


def directions(model: nn.Module, loss_fn: Any, x: Tensor,
               scale: ShiftScale | None = None) -> tuple[list[Tensor], list[Tensor]]:
    """(exact, difference) π(H·∇L) of a teleport's first step on the batch x (targets x) at τ = 1; ``scale``: the
    difference's learned shift factor (a ``Teleporter``'s ``shift``; None: its first shift, unlearned)."""
    from teleport.executors import SerialExecutor
    from teleport.geometry.blocks import build_blocks, moving_blocks
    from teleport.geometry.capture import UseRecorder, trainable
    from teleport.geometry.layer_bases import layer_bases
    from teleport.hvp.difference import shift_params, unshift
    from teleport.hvp.direction import ascent_direction, difference_direction
    from teleport.hvp.objective import objective, objective_tensors

    names, params = trainable(model)
    recorder = UseRecorder(names, params)
    cur = objective(model.eval(), loss_fn, x, x, params, None, 1.0, recorder, True, span_free=True)
    blocks = moving_blocks(layer_bases(build_blocks(recorder.uses)[0], 1.0, SerialExecutor()), 1.0, "numerical_rank")
    weights = [p for b in blocks for p in b.params]

    def shifted(along: list[Tensor], eps: Tensor) -> list[Tensor]:
        saved = shift_params(params, along, eps)
        try:
            return objective_tensors(model, loss_fn, x, x, params, graph=False)[0].global_grads
        finally:
            unshift(params, saved)

    exact = ascent_direction(cur, blocks, weights, params, None, TeleportConfig())
    return exact, difference_direction(cur, blocks, weights, params, shifted, scale)


def cosine(a: list[Tensor], b: list[Tensor]) -> float:
    """The cosine of two lists of tensors read as one vector, in float64."""
    dot = sum(float((u.detach().double() * v.detach().double()).sum()) for u, v in zip(a, b, strict=True))
    norm = [sum(float(t.detach().double().square().sum()) for t in ts) ** 0.5 for ts in (a, b)]
    return dot / (norm[0] * norm[1])


def fastest_way(cost: dict[str, Any], ascents: tuple[str, ...] | None = None) -> tuple[str, str]:
    """(teleport.ascent, teleport.hvp) whose 8 forced steps took the fewest seconds in ``cost``, among ``ascents``
    (default: every one measured); a row that failed never wins, a tie goes to the exact HVP, then the earlier
    ascent."""
    seconds = {(a, hvp): c.get("teleport_8_steps_s", math.inf)
               for hvp, rows in (("exact", cost["by_ascent"]), ("difference", cost["hvp_difference"]["by_ascent"]))
               for a, c in rows.items() if ascents is None or a in ascents}
    order = list(seconds)
    return min(seconds, key=lambda way: (seconds[way], way[1] != "exact", order.index(way)))


def cheaper_hvp(cost: dict[str, Any], ascent: str) -> str:
    """The teleport.hvp whose 8 forced steps took fewer seconds in ``cost`` with ``ascent`` (as it runs: not auto)."""
    return fastest_way(cost, (ascent,))[1]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--size", default=None, choices=["cpu", "gpu"], help="payoff size (default: the device's)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=None, help="payoff seeds (default 3, quick 1)")
    parser.add_argument("--ascent", default="auto", choices=["auto", "host", "device", "cuda_graph", "fastest"],
                        help="teleport.ascent of the payoff runs (the cost part measures every one); fastest: the "
                        "ascent and HVP whose 8 forced steps cost least in this run's cost part")
    parser.add_argument("--hvp", default="exact", choices=["exact", "difference", "cheaper"],
                        help="teleport.hvp of the payoff runs (the cost part measures both); cheaper: the one whose "
                        "8 forced steps cost less in this run's cost part, with the payoff's ascent (auto: what it "
                        "runs on this device)")
    add_machine_args(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    size = args.size or ("gpu" if device.type == "cuda" else "cpu")
    with quiet_machine("lm_payoff", args):
        cost = teleport_cost(device, args.quick, args.repeats or (1 if args.quick else 2))
        if args.ascent == "fastest":
            ascent, hvp = fastest_way(cost)
        else:
            ascent = args.ascent
            hvp = cheaper_hvp(cost, ascent_mode(TeleportConfig(ascent=ascent), device, None)) \
                if args.hvp == "cheaper" else args.hvp
        pay = payoff(device, size, args.quick, ascent, args.seeds or (1 if args.quick else 3), hvp)
    floor = 5.0 if device.type == "cuda" else 0.5
    fewest = min(((c["launches_per_step"], f"{a}, {hvp}") for hvp, by in (("exact", cost["by_ascent"]),
                  ("difference", cost["hvp_difference"]["by_ascent"])) for a, c in by.items() if "error" not in c),
                 default=(math.inf, "every way failed"))
    floors = {
        "launches_per_step_le_fifth": fewest[0] <= BEFORE_LAUNCHES / 5 if device.type == "cuda" else None,
        "one_teleport_default_le_floor": cost["teleport_default_in_train_steps"] <= floor,
        # the defaults meet it by taking no step (‖∇L‖² over CAP): the teleport that moves the LM is the one to judge
        "one_teleport_scale_free_le_floor": cost["teleport_scale_free_in_train_steps"] <= floor,
        "host_reads_per_step_le_1": cost["host_reads_per_step"] <= 1.0,
        **{f"{row}_seconds_ratio_le_1": (pay[row]["median_seconds_ratio"] or math.inf) <= 1.0
           for row in ("adam", "adam_lr2", "adam_scale_free")},
    }
    print_table(["teleport on 2 sequences", "seconds", "training steps", "steps taken"], [
        ["8 steps forced", f"{cost['teleport_8_steps_s']:.3f}", f"{cost['teleport_8_steps_in_train_steps']:.2f}", 8],
        ["product defaults", f"{cost['teleport_default_s']:.3f}", f"{cost['teleport_default_in_train_steps']:.2f}",
         f"{cost['default_steps_taken']} ({cost['default_stop_reason']})"],
        ["product defaults, check_first off", f"{cost['teleport_default_unchecked_s']:.3f}",
         f"{cost['teleport_default_unchecked_in_train_steps']:.2f}",
         f"{cost['default_steps_taken']} ({cost['default_stop_reason']})"],
        [f"rise {SCALE_FREE['rise']:g}, cap_ratio {SCALE_FREE['cap_ratio']:g} (‖∇L‖² ×{cost['scale_free_gain']:.2f})",
         f"{cost['teleport_scale_free_s']:.3f}",
         f"{cost['teleport_scale_free_in_train_steps']:.2f}",
         f"{cost['scale_free_steps_taken']} ({cost['scale_free_stop_reason']})"],
    ])
    print(f"launches of a teleport at CAP: {cost['default_launches']} with check_first, "
          f"{cost['default_unchecked_launches']} without")
    rows = [(f"{a}, {hvp}", c) for hvp, by in (("exact", cost["by_ascent"]),
                                                 ("difference", cost["hvp_difference"]["by_ascent"]))
            for a, c in by.items()]
    print_table(["8 steps forced: ascent, hvp", "ran as", "training steps", "launches / step", "host reads / step"], [
        [a, c["error"], "-", "-", "-"] if "error" in c else
        [a, c["ran_as"], f"{c['teleport_8_steps_in_train_steps']:.2f}", f"{c['launches_per_step']:.0f}",
         f"{c['host_reads_per_step']:.2f}"] for a, c in rows])
    print("where a forced teleport's time goes (training steps): " + "; ".join(
        f"{name}: evaluation + bases {c['phases_in_train_steps']['evaluation_and_bases']:.2f}, 8 steps "
        f"{c['phases_in_train_steps']['ascent']:.2f}" for name, c in rows if "phases_in_train_steps" in c))
    print("a teleport batch's setup (training steps; benchmarks.lm_setup): " + ", ".join(
        f"{k} {v:.2f}" for k, v in cost["setup_phases"]["in_train_steps"].items()))
    for name, c in rows:
        if "teleport_8_steps_new_batch_in_train_steps" in c:
            print(f"{name}: with a new batch each call {c['teleport_8_steps_new_batch_in_train_steps']:.2f} training "
                  f"steps (the graph replayed: same batch {c['graph_replayed']}, a new one "
                  f"{c['new_batch_graph_replayed']}); the scale-free teleport on a new batch each call "
                  f"{c['scale_free_new_batch_in_train_steps']:.2f} ({c['scale_free_steps']} steps, the graph replayed "
                  f"{c['scale_free_graph_replayed']})")
    print(f"fewest launches per ascent step: {fewest[0]:.0f} ({fewest[1]}); on CUDA the floor is <= 1/5 of the "
          f"{BEFORE_LAUNCHES:.0f} of the earlier ascent on an H100: "
          + ("n/a (CPU)" if floors["launches_per_step_le_fifth"] is None
             else verdict(floors["launches_per_step_le_fifth"])))
    print(f"teleport.hvp difference: its first direction's cosine to the exact one "
          f"{cost['hvp_difference']['direction_cosine']:.6f}")
    print(f"per ascent step (the host guard: auto on the CPU): {cost['launches_per_step']:.0f} launches, "
          f"{cost['host_reads_per_step']:.2f} host reads (floor <= 1: {verdict(floors['host_reads_per_step_le_1'])})")
    print_table(["optimizer", "seed", "baseline loss", "teleport loss", "seconds to its loss", "teleport share",
                 "batches ran as"], [
        [opt, r["seed"], f"{r['baseline_final_train_loss']:.4f}", f"{r['teleport_final_train_loss']:.4f}",
         "never" if r["seconds_ratio"] is None else f"{r['seconds_ratio']:.2f}x", f"{r['teleport_share']:.1%}",
         ", ".join(f"{a} {n}" for a, n in r["ascents"].items()) + f" ({r['graph_replays']} replayed)"]
        for opt, p in pay.items() for r in p["seeds"]])
    for opt, p in pay.items():
        median = "never" if p["median_seconds_ratio"] is None else f"{p['median_seconds_ratio']:.2f}x"
        print(f"{opt}: median over {len(p['seeds'])} seeds {median} the baseline's seconds, reached in "
              f"{p['reached']}/{len(p['seeds'])}, teleport share {p['median_teleport_share']:.1%}")
    print(f"one teleport <= {floor:g} training steps: defaults (no step) "
          f"{verdict(floors['one_teleport_default_le_floor'])}, scale-free ({cost['scale_free_steps_taken']} steps, "
          f"‖∇L‖² ×{cost['scale_free_gain']:.2f}) {verdict(floors['one_teleport_scale_free_le_floor'])}; "
          f"Adam to the baseline's loss in <= 1.0x its seconds: {verdict(floors['adam_seconds_ratio_le_1'])} "
          f"(teleport.lr 2, cap 1e4: {verdict(floors['adam_lr2_seconds_ratio_le_1'])}; scale-free "
          f"{verdict(floors['adam_scale_free_seconds_ratio_le_1'])})")
    print(f"payoff runs: teleport.ascent {ascent}, teleport.hvp {hvp} (asked: {args.ascent}, {args.hvp})")
    result = {"quick": args.quick, "device": str(device), "size": size, "ascent": ascent, "hvp": hvp,
              "ascent_asked": args.ascent, "hvp_asked": args.hvp,
              "cost": cost,
              "payoff": pay, "floors": floors}
    write_result("lm_payoff", result)
    return result


if __name__ == "__main__":
    main()
