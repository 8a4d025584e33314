"""Where the bases' batched float64 eigh runs: on the Grams' device, or on the host's cores, one matrix a thread.

An R whose full rank ``teleport.geometry.certificate`` cannot prove goes to ``bases.spectra``, whose eigh of the (b,
N, N) float64 Grams is the one decomposition of a teleport batch. On a trained model that is most of them: the
GPT-style LM of ``benchmarks.lm_payoff`` (d 256, 4 blocks, 4 × 64 tokens of Python source) has 8 of its 17 R proven at
initialisation, 1-2 after 50-300 AdamW steps (ranks 67-256 of 256 at float32's tolerance). On a GPU that eigh is
cuSOLVER's ``syevd`` in a loop over the batch (torch batches only N ≤ 32): 34 ms for the LM's 17 Grams of N = 256 on
an H200 (3.1 training steps), where the host's LAPACK took 66 ms for them one after another, copies included
(``benchmarks/results/h200/stop50``). One matrix per core, they run side by side.

Routes (``ROUTES``): ``device`` — ``torch.linalg.eigh`` on the Grams where they are; ``host`` — the Grams copied to
the host (the copy is the sync the device eigh makes anyway: it checks its info flag on the host), decomposed one per
thread of a pool of this process's torch threads (``executors.ThreadExecutor``: each single-threaded meanwhile), the
results copied back. Both are LAPACK-grade float64 eigh, so either keeps the f64 exactness of the bases (the kept
span is that of the eigenvectors of the nonzero eigenvalues, whichever solver found them).

``EighRoutes.eigh`` measures and chooses: the first time a (device, shape, threads) is met with two routes to run, it
runs each once warm and once timed, keeps the faster for the teleporter's model, and returns the kept route's result.
On the CPU with one torch thread there is one route (the pool would be a loop). A data-parallel teleport never comes
here (``teleport.distributed`` has its own spectra, the same on every rank).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from teleport.executors import ThreadExecutor

ROUTES = ("device", "host")
Key = tuple[str, int | None, tuple[int, ...], int]  # device type, index, the Grams' shape, torch threads


def on_device(grams: Tensor) -> tuple[Tensor, Tensor]:
    """The batched eigh where the Grams are (ascending eigenvalues, as ``torch.linalg.eigh``)."""
    return torch.linalg.eigh(grams)


def on_host(grams: Tensor) -> tuple[Tensor, Tensor]:
    """The batched eigh on the host: one Gram per pool thread (``ThreadExecutor``), back to the Grams' device."""
    # one copy to the host (the sync); a Gram a pool thread — in turn where there is one thread or one Gram
    parts = ThreadExecutor().map(torch.linalg.eigh, list(grams.cpu().unbind(0)))
    lam, vecs = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    return lam.to(grams.device), vecs.to(grams.device)


def run(route: str, grams: Tensor) -> tuple[Tensor, Tensor]:
    return on_device(grams) if route == "device" else on_host(grams)


def key(grams: Tensor) -> Key:
    return grams.device.type, grams.device.index, tuple(grams.shape), torch.get_num_threads()


def routes(grams: Tensor) -> tuple[str, ...]:
    """The routes worth choosing between for these Grams: on the CPU with one thread, or one Gram, they are one."""
    if grams.device.type == "cpu" and (torch.get_num_threads() < 2 or grams.shape[0] < 2):
        return ("device",)
    return ROUTES


class EighRoutes:
    """The route each key of Grams was measured fastest on, for one teleporter's model (its state: a resumed run
    keeps the choices, ``state_dict``). ``forced``: every ``eigh`` runs that route ("device", "host"; None: measured
    as usual) — for benchmarks and tests that set the routes side by side."""

    def __init__(self, forced: str | None = None) -> None:
        if forced is not None and forced not in ROUTES:
            raise ValueError(f"eigh route {forced!r}: one of {ROUTES}")
        self.forced = forced
        self.chosen: dict[Key, tuple[str, dict[str, float]]] = {}  # the route kept, and what each route took

    def eigh(self, grams: Tensor) -> tuple[Tensor, Tensor]:
        """``torch.linalg.eigh`` of a batch of Grams (b, N, N), by the route measured fastest for their key (see the
        module): the first call of a key times every route, later ones run the chosen one."""
        k = key(grams)
        route = self.forced or self.chosen.get(k, (None,))[0]
        if route is not None:
            return run(route, grams)
        candidates = routes(grams)
        if len(candidates) == 1:
            return run(candidates[0], grams)
        seconds, results = {}, {}
        for name in candidates:
            run(name, grams)  # warm: cuSOLVER's handle and workspace, the pool's threads
            seconds[name], results[name] = timed(lambda n=name: run(n, grams), grams.device)
        route = min(seconds, key=seconds.__getitem__)
        self.chosen[k] = route, seconds
        return results[route]

    def report(self) -> dict[str, dict[str, object]]:
        """Every choice made: "<device> <shape> <threads> threads" -> the route and each route's seconds."""
        return {f"{t}{'' if i is None else f':{i}'} {list(s)} {n} threads": {"route": r, "seconds": seconds}
                for (t, i, s, n), (r, seconds) in self.chosen.items()}

    def state_dict(self) -> list[list]:
        return [[list(k[:2]), list(k[2]), k[3], r] for k, (r, _) in self.chosen.items()]

    def load_state_dict(self, state: list[list]) -> None:
        self.chosen = {(t, i, tuple(s), n): (r, {}) for (t, i), s, n, r in state}


def eigh(grams: Tensor, chosen: EighRoutes | None = None) -> tuple[Tensor, Tensor]:
    """The batched eigh by ``chosen``'s routes; without any, where the Grams are."""
    return on_device(grams) if chosen is None else chosen.eigh(grams)


def timed(fn: Callable[[], tuple[Tensor, Tensor]], device: torch.device) -> tuple[float, tuple[Tensor, Tensor]]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out
