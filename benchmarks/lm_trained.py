"""One teleport of a *trained* GPT-style LM: where its bases go, and what the teleport costs.

``benchmarks.lm_payoff``'s cost part teleports the LM at initialisation, where ``teleport.geometry.certificate``
proves the full rank of most R (17 of 17 at d 512 on the CPU) and no eigh runs. A model in training is not like that:
after 50-300 AdamW steps on text most R are of lower rank at float32's tolerance, and their bases need the batched
float64 eigh of ``bases.spectra`` — on a GPU cuSOLVER's ``syevd`` one matrix after another
(``teleport.geometry.eigh_route``). This benchmark trains ``lm_payoff.GPT`` on Python source (``--train-steps``
AdamW steps of 32 sequences), then, from those weights and side by side in one run:

- how many R the certificate proves (``proven_full_rank`` of ``representations``) and the setup's phases
  (``benchmarks.lm_setup``: the eigh of the unproven Grams on the device and by the host route, pooled);
- the teleport that moves the LM (``api_schemas.spec.SCALE_FREE``, a new batch of the same shape each call, so a
  CUDA graph replays) in training steps, with the bases' eigh forced on the device, forced on the host, and as
  the teleporter's ``eigh_route.EighRoutes`` measure and choose (the product's default); the route they chose;
- the same teleport by each ``teleport.ascent`` (host guard, device ticks, on CUDA the CUDA graph), the eigh as chosen;
  on the CPU also by the CUDA graph's path with the capture emulated (``emulated_graph``): the kernels of a replayed
  batch, eager and in its graphs, what a GPU would launch one by one and replay;
- ``in_turn``: 12 new batches teleported one after the other from the trained weights, the aim at CAP learned from
  the batches before (``Teleporter.aim``, ``teleport.ascent.rules``: the default) and the first order's every time:
  back-offs, ‖∇L‖² gains and training steps of each.

Every teleport of the LM is by one ``Teleporter``, which keeps what one teaches the next (the aim at CAP, a CUDA
graph, the eigh routes chosen), as a training loop's would.

Sizes: ``--quick`` d 64, 2 blocks, context 32, 8 teleport sequences; else the full LM on either device, d 512,
4 blocks, context 128, a training step of 32 sequences, the teleport batch 2 (256 rows), trained 150 steps on the CPU
(~4 min on 2 cores), 300 on CUDA. (Earlier the CPU's was d 256, context 64, 4 sequences: a teleport batch of
1/8 of a training step's rows, not the full LM's 1/16; its teleport took 1.42 training steps where the full LM's took
0.49, both measured before the learned aim, ``teleport.ascent.rules``.)

    python -m benchmarks.lm_trained [--quick] [--device cpu|cuda] [--train-steps K] [--threads T]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import add_machine_args, print_table, quiet_machine, verdict, write_result
from benchmarks.graph_emulation import emulated_graphs
from benchmarks.lm_payoff import GPT, MOVING, _Kernels, _launches, _timed, lm_loss
from benchmarks.lm_setup import setup_phases
from teleport import TeleportConfig, Teleporter
from teleport.geometry.eigh_route import EighRoutes

SOURCES = ("json.decoder", "json.encoder", "argparse", "dataclasses")  # standard-library text, on every machine
ROUTES = ("device", "host", None)  # None: measured and chosen (the default)
ASCENTS = {"cpu": ("host", "device"), "cuda": ("host", "device", "cuda_graph")}  # ``TeleportConfig.ascent``
EMULATED_WARM = 3  # batches before the one counted by the emulated CUDA graph's path (its warm-up and captures)
TURNS = 12  # batches teleported in turn, with the aim at CAP learned and without


def text_tokens() -> torch.Tensor:
    """Bytes of a few standard-library modules' source: real text for a char LM, vocabulary 256."""
    spec_paths = [importlib.util.find_spec(m).origin for m in SOURCES]  # type: ignore[union-attr]
    text = b"".join(Path(p).read_bytes() for p in spec_paths if p)
    return torch.tensor(list(text), dtype=torch.long)


def sizes(device: torch.device, quick: bool) -> dict[str, int]:
    if quick:
        return {"d": 64, "layers": 2, "ctx": 32, "teleport_batch": 8, "train_steps": 30}
    steps = 300 if device.type == "cuda" else 150
    return {"d": 512, "layers": 4, "ctx": 128, "teleport_batch": 2, "train_steps": steps}


def trained_cost(device: torch.device, quick: bool, repeats: int, train_steps: int | None) -> dict[str, Any]:
    """Train the LM, then measure (see the module) from its trained weights."""
    size = sizes(device, quick)
    steps = train_steps or size["train_steps"]
    torch.manual_seed(0)
    data = text_tokens().to(device)
    model = GPT(256, size["d"], size["layers"], size["ctx"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch(n: int) -> torch.Tensor:  # (n, ctx) windows of the text
        start = torch.randint(0, len(data) - size["ctx"], (n,), device=device)
        return data[start[:, None] + torch.arange(size["ctx"], device=device)]

    def train_step() -> float:
        b = batch(32)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(b), b)
        loss.backward()
        opt.step()
        return float(loss.detach())

    first = train_step()
    last = [train_step() for _ in range(steps - 1)][-1]
    step_s, _ = _timed(train_step, device, repeats)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    tele = batch(size["teleport_batch"])
    batches = [batch(size["teleport_batch"]) for _ in range(3)]
    others = itertools.cycle(batches)
    teleporter = Teleporter(model, lm_loss)

    def moving(ascent: str = "auto") -> Any:
        model.load_state_dict(trained)  # in place: every call from the trained weights
        x = next(others)
        return teleporter.teleport(x, x, config=TeleportConfig(steps=8, ascent=ascent, **MOVING))

    def row(fn: Any) -> dict[str, Any]:
        seconds, report = _timed(fn, device, repeats)
        launches, _ = _launches(fn, device, teleporter.reads)
        return {"seconds": seconds, "in_train_steps": seconds / step_s, "launches": launches, "steps": report.steps,
                "backoffs": report.backoffs, "gain": report.grad_norm_sq_after / report.grad_norm_sq_before,
                "ascent": report.ascent, "drift": abs(report.loss_after - report.loss_before)}

    by_route: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        others = itertools.cycle(batches)  # every route the same batches in the same order
        teleporter.routes = EighRoutes(forced=route)  # None, last: measured and chosen afresh, then kept
        by_route[route or "chosen"] = row(moving)
    chosen = teleporter.routes.report()
    # the same teleport by each way of running its steps (the eigh as chosen): the device ticks are the CUDA graph's
    # eager fallback, their judging tick without the double backward as in the graph (``on_device.DeviceAscent``)
    by_ascent = {ascent: row(lambda a=ascent: moving(a)) for ascent in ASCENTS[device.type]}
    emulated = emulated_replay(teleporter, lambda: moving("cuda_graph")) if device.type == "cpu" else None
    in_turn = {name: batches_in_turn(teleporter, trained, [batch(size["teleport_batch"]) for _ in range(TURNS)],
                                     learned, step_s, device)
               for name, learned in (("first_order", False), ("learned", True))}
    model.load_state_dict(trained)
    setup = setup_phases(model, lm_loss, tele, step_s, lambda fn: _timed(fn, device, repeats), teleporter.routes)
    return {"model": size | {"train_steps": steps}, "train_loss": {"first": first, "last": last},
            "train_step_s": step_s, "by_route": by_route, "by_ascent": by_ascent, "emulated_graph": emulated,
            "eigh_route_chosen": chosen,
            "in_turn": in_turn,
            "setup_phases": setup}


def emulated_replay(teleporter: Teleporter, teleport: Any, warm_batches: int = EMULATED_WARM) -> dict[str, Any]:
    """The moving teleport (``teleport``: by ``teleporter``) by the CUDA graph's path on the CPU, the capture emulated
    (``benchmarks.graph_emulation``): after ``warm_batches`` (the warm-up, the captures), the kernels of one replayed
    batch — eager (its setup: the recorded forward, the bases) and in its graphs — and the full and judging ticks it
    replayed."""
    with emulated_graphs() as emulation:
        try:
            for _ in range(warm_batches):
                teleport()
            before = dict(emulation.replays)
            with _Kernels(inside=lambda: emulation.replaying) as kernels:
                report = teleport()
        finally:
            teleporter.graphs.release()  # its "graphs" are the emulation's: no later teleport may replay them
    return {"eager_kernels": kernels.count - kernels.in_graph, "graph_kernels": kernels.in_graph,
            "full_ticks": emulation.replays[True] - before[True],
            "judging_ticks": emulation.replays[False] - before[False], "graph_replayed": report.graph_replayed,
            "captures": len(emulation.made), "steps": report.steps, "backoffs": report.backoffs,
            "gain": report.grad_norm_sq_after / report.grad_norm_sq_before}


def batches_in_turn(teleporter: Teleporter, trained: dict[str, torch.Tensor], xs: list[torch.Tensor], learned: bool,
                    step_s: float, device: torch.device) -> dict[str, Any]:
    """The moving teleport of each batch of ``xs`` in turn by ``teleporter``, each from the trained weights, the aim
    at CAP learned from the batches before (``Teleporter.aim``) or the first order's every time: back-offs, ‖∇L‖² gain
    and training steps of each. Only the aim is forgotten (the rest the teleporter keeps, as a training loop's)."""
    teleporter.aim = None
    config = TeleportConfig(steps=8, **MOVING)
    rows = []
    for x in xs:
        teleporter.model.load_state_dict(trained)
        if not learned:
            teleporter.aim = None
        seconds, report = _timed(lambda x=x: teleporter.teleport(x, x, config=config),
                                 device, 1, warm=False)  # once: a warm-up would teach the aim this very batch
        rows.append({"backoffs": report.backoffs, "gain": report.grad_norm_sq_after / report.grad_norm_sq_before,
                     "in_train_steps": seconds / step_s})
    return {"batches": rows, "backoffs": sum(r["backoffs"] for r in rows),
            "mean_in_train_steps": sum(r["in_train_steps"] for r in rows) / len(rows)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--train-steps", type=int, default=None, help="AdamW steps before the teleport")
    parser.add_argument("--repeats", type=int, default=None)
    add_machine_args(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    with quiet_machine("lm_trained", args) as threads:
        cost = trained_cost(device, args.quick, args.repeats or (1 if args.quick else 3), args.train_steps)
    setup, floor = cost["setup_phases"], 5.0 if device.type == "cuda" else 0.5
    m = cost["model"]
    print(f"GPT-style LM d {m['d']}, {m['layers']} blocks, context {m['ctx']}, after {m['train_steps']} AdamW steps "
          f"(train loss {cost['train_loss']['first']:.3f} -> {cost['train_loss']['last']:.3f}); {threads} threads")
    print(f"R proven full rank: {setup['proven_full_rank']} of {setup['representations']}; the unproven Grams "
          f"{setup['unproven_gram_batches']}")
    print_table(["the teleport that moves the trained LM, eigh", "training steps", "seconds", "launches", "steps",
                 "back-offs", "‖∇L‖² gain", "ran as"],
                [[name, f"{r['in_train_steps']:.2f}", f"{r['seconds']:.4f}", r["launches"], r["steps"], r["backoffs"],
                  f"{r['gain']:.2f}", r["ascent"]] for name, r in cost["by_route"].items()])
    print_table(["the same by the ascent", "training steps", "seconds", "launches", "steps", "back-offs",
                 "‖∇L‖² gain", "ran as"],
                [[name, f"{r['in_train_steps']:.2f}", f"{r['seconds']:.4f}", r["launches"], r["steps"], r["backoffs"],
                  f"{r['gain']:.2f}", r["ascent"]] for name, r in cost["by_ascent"].items()])
    if (emu := cost["emulated_graph"]) is not None:
        print(f"by the CUDA graph's path, the capture emulated on the CPU: the batch after {EMULATED_WARM} "
              f"({'replayed from' if emu['graph_replayed'] else 'not replayed from'} the model's graph) launches "
              f"{emu['eager_kernels']} kernels eagerly and {emu['graph_kernels']} from its graphs "
              f"({emu['full_ticks']} full tick(s), {emu['judging_ticks']} judging, {emu['captures']} capture(s) of the "
              f"full tick in {1 + EMULATED_WARM} batches; {emu['steps']} step(s), "
              f"{emu['backoffs']} back-off(s), ‖∇L‖² ×{emu['gain']:.2f})")
    print("eigh routes chosen: " + ("; ".join(f"{k}: {v['route']} (" + ", ".join(
        f"{r} {s * 1e3:.1f} ms" for r, s in v["seconds"].items()) + ")" for k, v in cost["eigh_route_chosen"].items())
        or "none to choose between (one CPU thread)"))
    for name, turn in cost["in_turn"].items():
        print(f"{TURNS} batches in turn, the aim at CAP {name.replace('_', ' ')}: back-offs "
              f"{[r['backoffs'] for r in turn['batches']]}, ‖∇L‖² gains "
              f"{[round(r['gain'], 2) for r in turn['batches']]}, "
              f"{turn['mean_in_train_steps']:.2f} training steps each")
    print("its setup (training steps; benchmarks.lm_setup): " + ", ".join(
        f"{k} {v:.2f}" for k, v in setup["in_train_steps"].items()))
    ok = cost["by_route"]["chosen"]["in_train_steps"] <= floor
    print(f"one teleport of the trained LM <= {floor:g} training steps (the floor, on a model in training): "
          f"{verdict(ok)}")
    result = {"quick": args.quick, "device": str(device), "threads": threads, "cost": cost,
              "floors": {"one_teleport_trained_le_floor": ok}}
    write_result("lm_trained", result)
    return result


if __name__ == "__main__":
    main()
