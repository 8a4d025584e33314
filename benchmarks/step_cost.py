"""Cost of one null-space teleport step relative to one forward + backward on the same batch.

Three models of the paper's kinds, n = 32 each:

- ``mlp``: 784 → 1024 → 1024 → 10, LeakyReLU (the paper's large MNIST MLP);
- ``cnn``: three 3×3 convs with 16, 32, 64 channels (ReLU, 2×2 max-pool each) on 3×32×32, linear head
  (the paper's CIFAR CNN);
- ``transformer``: 2 pre-LN blocks, d = 128, 4 heads, Linear Q/K/V/O, FF 4d, T = 64 tokens, mean
  pooling, linear head; attention by ``F.scaled_dot_product_attention``.

Measured side by side, interleaved: a plain training step without optimizer (``zero_grad``,
forward, ``backward``; the transformer with the default SDPA kernel and, for reference, with the
math kernel that teleport forces for its double backward), a ``Teleporter``'s teleport with ``steps=0``
(capture R + the first objective + the bases: the per-batch overhead) and with ``steps=t``.

    amortized step      = T(steps=t) / t                    (bases included)
    step excl. bases    = (T(steps=t) − T(steps=0)) / t

each divided by the fwd+bwd time. Floor (printed, not asserted): step excl. bases ≤ 3× fwd+bwd.
A second table splits a step into its parts, each timed alone: L and ∇L with their graph and
‖∇L‖², the direction π(H·∇L) (the second backward and π, as a step computes them: at τ = 1 a Linear's
from its factors, ``teleport.hvp.factored``), and the rest; plus the per-batch bases.

On a GPU (``--device cuda``) the training step is also timed under bf16 autocast ('f+b bf16', how a
lab trains there); the teleport itself always runs in float32 with TF32 off (``teleport.modes``),
and the ratios stay against the float32 fwd+bwd, the same precision as the teleport.

    python -m benchmarks.step_cost [--quick] [--repeats R] [--threads K] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import (
    Canary,
    add_machine_args,
    leaky_mlp,
    print_table,
    quiet_machine,
    time_interleaved,
    verdict,
    write_result,
)
from teleport import SerialExecutor, TeleportConfig, Teleporter, TeleportReport, capture_inputs
from teleport.geometry.eigh_route import EighRoutes

STEPS = 8
LR = 1e-3  # small, so that with CAP and loss_tol disabled every step is accepted
NO_STOP = {"cap": 1e12, "loss_tol": 1e9}
FLOOR = 3.0  # the step-cost floor
MAX_SPREAD, RETRIES = 1.5, 2  # re-measure when repeats or the canary are >1.5x off
CLASSES = 10


def cnn(channels: list[int], size: int) -> nn.Module:
    blocks: list[nn.Module] = []
    for c_in, c_out in zip([3, *channels[:-1]], channels, strict=True):
        blocks += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
    side = size // 2 ** len(channels)
    return nn.Sequential(*blocks, nn.Flatten(), nn.Linear(channels[-1] * side * side, CLASSES))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h: Tensor) -> Tensor:
        b, t, d = h.shape
        a = self.ln1(h)
        q, k, v = (p(a).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v)  # (b, heads, t, d / heads)
        h = h + self.o(att.transpose(1, 2).reshape(b, t, d))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class Transformer(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(length, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, CLASSES)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h).mean(1))


def models(quick: bool, device: str = "cpu") -> dict[str, tuple[nn.Module, Tensor, Tensor]]:
    """name -> (model, x, y), seeded (on the CPU, then moved to ``device``)."""
    torch.manual_seed(0)
    n = 4 if quick else 32
    width, channels, size = (32, [4, 8], 8) if quick else (1024, [16, 32, 64], 32)
    d, length = (16, 8) if quick else (128, 64)
    vocab = 256
    y = torch.randint(0, CLASSES, (n,))
    built = {
        "mlp": (leaky_mlp([784, width, width, CLASSES]), torch.randn(n, 784), y),
        "cnn": (cnn(channels, size), torch.randn(n, 3, size, size), y),
        "transformer": (Transformer(vocab, d, 4, 2, length), torch.randint(0, vocab, (n, length)), y),
    }
    return {name: (m.to(device), x.to(device), t.to(device)) for name, (m, x, t) in built.items()}


def measure(model: nn.Module, x: Tensor, y: Tensor, steps: int, warmup: int, repeats: int,
            canary: Canary | None = None, routes: EighRoutes | None = None) -> dict[str, Any]:
    """``routes``: the eigh routes every teleport measured takes (one ``EighRoutes`` for the run: each teleport is of a
    fresh copy of the model, by a teleporter of its own, and measures no route a teleport before it chose)."""
    routes = EighRoutes() if routes is None else routes

    def fwd_bwd(m: nn.Module) -> float:
        m.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        return float(loss.detach())

    def fwd_bwd_math(m: nn.Module) -> float:
        with sdpa_kernel(SDPBackend.MATH):
            return fwd_bwd(m)

    def fwd_bwd_bf16(m: nn.Module) -> float:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return fwd_bwd(m)

    def teleport(t: int) -> Callable[[nn.Module], TeleportReport]:
        config = TeleportConfig(steps=t, lr=LR, **NO_STOP)

        def one(m: nn.Module) -> TeleportReport:
            teleporter = Teleporter(m, F.cross_entropy, config)
            teleporter.routes = routes
            return teleporter.teleport(x, y)

        return one

    def fresh() -> nn.Module:
        return copy.deepcopy(model)

    bf16 = {"fwd_bwd_bf16": (fwd_bwd_bf16, lambda: model)} if x.device.type == "cuda" else {}
    timings = time_interleaved({
        "fwd_bwd": (fwd_bwd, lambda: model),
        "fwd_bwd_math_sdpa": (fwd_bwd_math, lambda: model),
        **bf16,
        "teleport_0": (teleport(0), fresh),
        "teleport_t": (teleport(steps), fresh),
    }, warmup=warmup, repeats=repeats, max_spread=MAX_SPREAD, retries=RETRIES, canary=canary)
    report: TeleportReport = timings["teleport_t"]["value"]
    if report.steps != steps or report.backoffs:
        raise RuntimeError(f"teleport took {report.steps} steps ({report.backoffs} back-offs, stop reason "
                           f"{report.stop_reason}); expected {steps}: lower LR in benchmarks/step_cost.py")
    fb = timings["fwd_bwd"]["median"]
    t0, tt = timings["teleport_0"]["median"], timings["teleport_t"]["median"]
    step_excl = max(tt - t0, 0.0) / steps
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "free_directions": report.free_directions,
        "layers": [layer.__dict__ for layer in report.layers],
        "steps": report.steps,
        "seconds": {k: {"median": v["median"], "min": v["min"], "samples": v["samples"], "spread": v["spread"],
                        "attempts": v["attempts"]} for k, v in timings.items()},
        "spread": max(v["spread"] for v in timings.values()),
        "contention": max(v["contention"] for v in timings.values()),
        "fwd_bwd_seconds": fb,
        "overhead_seconds": t0,
        "amortized_step_seconds": tt / steps,
        "step_excl_bases_seconds": step_excl,
        "ratio_overhead": t0 / fb,
        "ratio_amortized_step": tt / steps / fb,
        "ratio_step_excl_bases": step_excl / fb,
    }


def breakdown(model: nn.Module, x: Tensor, y: Tensor, warmup: int, repeats: int,
              canary: Canary | None = None, routes: EighRoutes | None = None) -> dict[str, float]:
    """Seconds of the parts of one step, timed alone with the library's own pieces on a copy of the model.

    objective: L and ∇L with its graph and ‖∇L‖²; direction: π(H·∇L) on every layer a step moves, the
    second backward and π as a step at τ = 1 computes them (span-free Linear graphs, factored π, data-reading
    layers left out); bases: capture's R → SVD/eigh per layer (once per batch, not per step), the eigh by
    ``routes`` (``measure``'s).
    """
    from teleport.geometry.blocks import moving_blocks
    from teleport.geometry.layer_bases import layer_bases
    from teleport.hvp.direction import project_blocks
    from teleport.hvp.factored import factored_direction
    from teleport.hvp.objective import objective, teleport_gradient_and

    m = copy.deepcopy(model).eval()
    params = [p for p in m.parameters() if p.requires_grad]
    with capture_inputs(m) as captured:
        first = objective(m, F.cross_entropy, x, y, params, span_free=True)  # as a step at τ = 1 does
    layers = moving_blocks(layer_bases(captured, 1.0, SerialExecutor(), routes=routes), 1.0,
                           "numerical_rank")  # what a step moves
    del first

    def direction(_: Any) -> list[Tensor]:
        obj = objective(m, F.cross_entropy, x, y, params, span_free=True)
        return factored_direction(obj, layers, None, teleport_gradient_and, project_blocks)

    t = time_interleaved({
        "objective": (lambda _: objective(m, F.cross_entropy, x, y, params, span_free=True), None),
        "objective_direction": (direction, None),
        "bases": (lambda _: layer_bases(captured, 1.0, SerialExecutor(), routes=routes), None),
    }, warmup=warmup, repeats=repeats, max_spread=MAX_SPREAD, retries=RETRIES, canary=canary)
    med = {k: v["median"] for k, v in t.items()}
    return {"objective": med["objective"], "direction": max(med["objective_direction"] - med["objective"], 0.0),
            "bases": med["bases"]}


def run(quick: bool, steps: int, warmup: int, repeats: int, device: str = "cpu") -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    canary = Canary()
    routes = EighRoutes()  # the run's: every teleport takes the routes measured by the first that met its Grams
    for name, (model, x, y) in models(quick, device).items():
        print(f"  {name}: {sum(p.numel() for p in model.parameters()):,} parameters, x {tuple(x.shape)} ...",
              flush=True)
        rows[name] = measure(model, x, y, steps, warmup, repeats, canary, routes)
        parts = breakdown(model, x, y, warmup, repeats, canary, routes)
        parts["rest"] = max(rows[name]["step_excl_bases_seconds"] - parts["objective"] - parts["direction"], 0.0)
        rows[name]["breakdown_seconds"] = parts
    def ms(r: dict[str, Any], case: str) -> str:
        return f"{r['seconds'][case]['median'] * 1e3:.2f}" if case in r["seconds"] else "-"

    table = [[name, f"{r['fwd_bwd_seconds'] * 1e3:.2f}", ms(r, "fwd_bwd_math_sdpa"), ms(r, "fwd_bwd_bf16"),
              f"{r['overhead_seconds'] * 1e3:.2f}", f"{r['amortized_step_seconds'] * 1e3:.2f}",
              f"{r['step_excl_bases_seconds'] * 1e3:.2f}", f"{r['ratio_overhead']:.2f}x",
              f"{r['ratio_amortized_step']:.2f}x", f"{r['ratio_step_excl_bases']:.2f}x", r["free_directions"],
              f"{r['spread']:.2f}", f"{r['contention']:.2f}"]
             for name, r in rows.items()]
    print(f"\nstep cost (t = {steps}, {device}); times in ms, ratios to fwd+bwd")
    text = print_table(["model", "fwd+bwd", "f+b math", "f+b bf16", "steps=0", "step amort.", "step excl.",
                        "overhead/fb", "amort./fb", "excl./fb", "free dirs", "spread", "contention"], table)
    def share(r: dict[str, Any], part: str) -> str:
        sec = r["breakdown_seconds"][part]
        return f"{sec * 1e3:.2f} ({sec / max(r['step_excl_bases_seconds'], 1e-12):.0%})"

    print("\nwhere a step goes (ms, share of 'step excl.'), each part timed alone; bases are per batch")
    parts_table = [[name, f"{r['step_excl_bases_seconds'] * 1e3:.2f}", share(r, "objective"), share(r, "direction"),
                    share(r, "rest"), f"{r['breakdown_seconds']['bases'] * 1e3:.2f}"]
                   for name, r in rows.items()]
    text += "\n\n" + print_table(["model", "step excl.", "L,∇L,‖∇L‖²", "π(H·∇L)", "rest", "bases"],
                                  parts_table)
    floors = [{"floor": f"{name}: one null-space step (excl. bases) <= {FLOOR:g}x fwd+bwd",
               "value": r["ratio_step_excl_bases"], "limit": FLOOR, "pass": r["ratio_step_excl_bases"] <= FLOOR}
              for name, r in rows.items()]
    print()
    for f in floors:
        print(f"{verdict(f['pass'])}  {f['floor']}: {f['value']:.2f}x")
    for name, r in rows.items():
        ok = r["ratio_amortized_step"] <= FLOOR
        print(f"  (info) {name}: amortized step incl. bases {r['ratio_amortized_step']:.2f}x "
              f"({'within' if ok else 'above'} {FLOOR:g}x)")
    notes = [
        f"torch.set_num_threads({torch.get_num_threads()}); medians of {repeats} interleaved repeats after "
        f"{warmup} warm-up; teleport runs on a fresh copy of the model each time; spread = upper-quartile / "
        "fastest repeat (worst case); contention = slowdown of a fixed matmul canary timed around the measurement over "
        f"its quiet baseline (1.0 = the machine was ours); re-measured up to {RETRIES} times when either exceeds "
        f"{MAX_SPREAD}",
        "fwd+bwd = zero_grad(set_to_none) + forward + cross-entropy + backward, no optimizer; 'f+b math' forces "
        "the math SDPA kernel (what teleport's double backward needs)",
        "steps=0 = capture R + first objective (create_graph) + bases; a step = H·∇L (double backward), "
        "projection (at τ = 1 a Linear's from its factors), and one re-evaluation of L and ∇L with its graph",
        f"lr {LR}, CAP and loss_tol disabled: every step accepted, no back-off",
        "breakdown: 'rest' = step excl. minus the timed parts (the move, ‖U‖² for the CAP aim, bookkeeping); "
        "parts timed alone do not add up exactly to a step",
    ]
    print("\nnotes:\n" + "\n".join(f"- {n}" for n in notes), flush=True)
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "steps": steps, "repeats": repeats, "warmup": warmup, "lr": LR, "floor": FLOOR, "models": rows,
            "floors": floors, "notes": notes, "table": text}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models (seconds), for the smoke test")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 7, quick 1)")
    parser.add_argument("--steps", type=int, default=None, help=f"teleport steps t (default {STEPS}, quick 2)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the models run (cuda: results go to step_cost_cuda.json)")
    add_machine_args(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here")
    with quiet_machine("step_cost", args):
        if args.quick:
            result = run(True, args.steps or 2, warmup=0, repeats=args.repeats or 1, device=args.device)
        else:
            result = run(False, args.steps or STEPS, warmup=2, repeats=args.repeats or 7, device=args.device)
        name = "step_cost" if args.device == "cpu" else "step_cost_cuda"
        write_result(name, {"quick": args.quick, **result})  # machine info: the threads it ran with
    return result


if __name__ == "__main__":
    main()
