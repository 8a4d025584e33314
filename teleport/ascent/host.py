"""The host guard: Algorithm 1's steps decided in Python on L and ‖∇L‖² read after every try (``host_guard``).

Each step: U = π(H·∇L) at the weights as they are; the first try's η decided on the device (``rules.aim_on_device``)
and read back with the try's L and ‖∇L‖² (one sync a step); then ``guarded_step`` accepts, shortens or gives up by
``teleport.ascent.rules``. Fastest on the CPU and across data-parallel ranks (every rank reads the same reduced
numbers, so every rank decides alike).

Steps without copying the weights (``StepBuffers``).

A step tries W = W₀ + η·U and, when the guard refuses it, shorter ones from the same W₀, or puts W₀
back. Keeping W₀ by copying the weights before every step costs two passes over them (a read and a
write: ~0.5× a forward+backward of an MLP [1024, 1024] at n = 32, where every pass over the 1.9 M
weights counts). Instead each weight has a spare buffer of its shape: a try writes W₀ + η·U into the
spare and swaps the storages (``p.data = spare``), so W₀ stays where it was, untouched. Accepting
the step makes W₀'s buffer the next spare; refusing every try swaps W₀ back. Bit-identical to the
copy: the same ``torch.add(W₀, U, alpha=η)`` writes the same values, and nothing is added twice.

``finish`` puts every parameter back into its own storage (one copy, when it ended in the spare),
so whoever holds the parameter or a view of its storage (an optimizer, DDP, a flat buffer) sees
the teleported values in the place it knows.

"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from teleport.ascent.rules import aim_on_device, shorten, step_verdict
from teleport.ascent.run import AscentBatch, Evaluate, Tensors
from teleport.config import TeleportConfig
from teleport.hvp.objective import Objective
from teleport.modes import in_dtypes


def host_guard(batch: AscentBatch, evaluate: Evaluate, tensors: Tensors) -> str:
    """The batch's steps, guarded on the host (an ``Ascent``)."""
    if reason := batch.undefer(evaluate):  # the host guard steps from a start it has read
        return reason
    buffers = StepBuffers(batch.weights)
    try:
        return _steps(batch, buffers, evaluate)
    finally:
        buffers.finish()


def _steps(batch: AscentBatch, buffers: StepBuffers, evaluate: Evaluate) -> str:
    config, eta = batch.config, batch.config.lr
    direction_of = batch.direction(batch.comm)
    while batch.steps < config.steps:
        if batch.cur.grad_norm_sq >= config.cap:
            return "cap"
        direction = direction_of(batch.cur)
        if batch.scale is not None:  # a direction that starts a step: the difference's proposed shift kept
            batch.scale.commit()
        last = batch.steps + 1 == config.steps  # no H·∇L follows the last step: its graph is not kept
        # the first try's η is decided on the device and read back with its L and ‖∇L‖²: one sync a step
        eta_t, aimed_t, slope_t = aim_on_device(eta, batch.cur.grad_norm_sq, direction, config.cap, config.rise,
                                                batch.aim)
        buffers.move(direction, eta_t)
        first = evaluate(graph=not last, fetch=(eta_t, aimed_t, slope_t))
        try_eta, aimed, slope = first.fetched[0], bool(first.fetched[1]), first.fetched[2]
        new, used, tries, why = guarded_step(
            partial(buffers.move, direction), buffers.restore,
            partial(evaluate, graph=not last), batch.loss0, try_eta, config, batch.cur.grad_norm_sq,
            final_evaluate=partial(evaluate, graph=False), aimed=aimed, first=first, slope=slope)
        eta = used if not aimed else eta
        batch.backoffs += tries
        if new is None:
            return why
        if aimed:  # it landed: what it took teaches the model's next aim
            batch.aim.learn(None, eta_t, used, new.grad_norm_sq - batch.cur.grad_norm_sq,
                            config.cap - batch.cur.grad_norm_sq)
        buffers.accept()
        batch.cur, batch.steps = new, batch.steps + 1
        if why == "cap":  # shortened to fit under CAP: CAP is reached, further steps would overshoot
            return "cap"
    return "steps"


def guarded_step(
    move: Callable[[float], None],
    restore: Callable[[], None],
    evaluate: Callable[[], Objective],
    loss0: float,
    eta: float,
    config: TeleportConfig,
    grad_norm_sq: float | None = None,
    final_evaluate: Callable[[], Objective] | None = None,
    aimed: bool = False,
    first: Objective | None = None,
    slope: float | None = None,
) -> tuple[Objective | None, float, int, str]:
    """Take a step of size η, shortening it until the step is acceptable.

    Acceptable: L and ‖∇L‖² finite, ‖∇L‖² ≤ CAP, |L − L₀| ≤ loss_tol·|L₀| (a rise or a fall), and —
    given the ‖∇L‖² before the step — an ascent. A step over CAP is shortened by the secant to CAP
    (from the ‖∇L‖² before and after it, given ``grad_norm_sq``), anything else by halving.
    Returns the objective after the accepted step (None when every try failed and ``restore`` put
    the weights back), the η that worked (kept for the next step), the back-offs and why it ended:
    "steps" (accepted), "cap" (accepted once shortened to fit under CAP — or ``aimed`` there from the
    start: CAP is reached), or on failure "not_finite", "cap", "loss_tol" or "no_ascent".
    A try whose acceptance would end the teleport ("cap") is evaluated by ``final_evaluate`` when
    given (no graph for an H·∇L that will never be asked for). ``first``: the first try, already moved
    to and evaluated by the caller (η decided on the device, see ``aim_on_device``).
    """
    why = "cap" if aimed else "steps"
    for attempt in range(config.max_backoff + 1):
        if attempt == 0 and first is not None:
            new = first
        else:
            move(eta)
            new = (final_evaluate or evaluate)() if why == "cap" else evaluate()
        verdict = step_verdict(new.loss, new.grad_norm_sq, loss0, config, grad_norm_sq)
        if verdict == "steps":
            return new, eta, attempt, "cap" if why == "cap" else "steps"
        why = verdict
        if attempt < config.max_backoff:
            eta *= shorten(why, new.grad_norm_sq, grad_norm_sq, config.cap, None if slope is None else slope * eta)
    restore()
    return None, eta, config.max_backoff + 1, why


class StepBuffers:
    """Two storages per moving weight: the one the parameter holds now, and a spare."""

    def __init__(self, weights: list[Tensor]) -> None:
        self.weights = weights
        self.home = [w.data for w in weights]  # the parameters' own storage, where they end
        self.spare = [torch.empty_like(w) for w in weights]
        self.origin: list[Tensor] | None = None  # W₀ of the step being tried (not the parameters' storage)

    def move(self, direction: list[Tensor], eta: float | Tensor) -> None:
        """W = W₀ + η·U, W₀ being the weights when this step's first try began; η a number or a 0-d tensor
        on the weights' device (decided there: no host sync)."""
        with torch.no_grad():
            if self.origin is None:  # first try of a step: the spare takes W₀ + ηU, W₀ stays put
                self.origin = [w.data for w in self.weights]
                for w, s in zip(self.weights, self.spare, strict=True):
                    w.data = s
            etas = in_dtypes(eta, direction) if isinstance(eta, Tensor) else {}
            for w, w0, u in zip(self.weights, self.origin, direction, strict=True):
                if isinstance(eta, Tensor):
                    torch.addcmul(w0, u, etas[u.dtype], out=w)
                else:
                    torch.add(w0, u, alpha=eta, out=w)

    def restore(self) -> None:
        """Back to W₀ (no try of this step is kept)."""
        if self.origin is None:
            return
        tried = [w.data for w in self.weights]
        for w, w0 in zip(self.weights, self.origin, strict=True):
            w.data = w0
        self.spare, self.origin = tried, None

    def accept(self) -> None:
        """Keep the last try: W₀'s storage is the next step's spare."""
        if self.origin is not None:
            self.spare, self.origin = self.origin, None

    def finish(self) -> None:
        """Every parameter back in its own storage, holding the last accepted values (a try still in
        flight, when an error cut the step short, is dropped)."""
        self.restore()
        with torch.no_grad():
            for w, home in zip(self.weights, self.home, strict=True):
                if w.data_ptr() != home.data_ptr():
                    home.copy_(w.data)
                    w.data = home
        self.spare, self.origin = [], None
