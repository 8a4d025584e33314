"""The ascent of one teleport decided on the device, in ticks that a CUDA graph captures and replays.

The host guard (``teleport.ascent.host``) reads L and ‖∇L‖² after every try and branches in Python:
accept, shorten, stop. On a GPU each step is then thousands of small kernels launched one by one from
Python (15,268 launches for one teleport of a GPT-style LM on an H100), and the GPU waits on the host.

Here the same rules (``teleport.ascent.rules``: finite, ≤ CAP, |L − L₀| ≤ loss_tol·|L₀|, an
ascent; a CAP overshoot shortened to land under it, else halving; η aimed at CAP) runs as arithmetic on 0-d
device tensors.
One *tick* evaluates the objective at the weights as they are, judges the try in flight, and moves:
to a shorter try of the same step (from W₀, along the same U), back to W₀ when every try failed, or —
once a try is accepted — to the first try of the next step along the new U = π(H·∇L). Every choice
is a ``torch.where``, so a tick has fixed shapes and addresses and reads nothing on the host: on
CUDA it is captured once per teleport batch (``CUDAGraph.capture_begin``, after ``WARMUP`` eager ticks)
and replayed, one launch a tick. The host reads one small status (``STATUS``: done, steps, a try in
flight, back-offs, the reason, L, ‖∇L‖², and both at the start) per tick, in one copy: one sync per step, as
before, but no longer between kernels. The first tick takes step 1 from the evaluation the bases were built from
— or, replayed from a graph, evaluates the start itself and sets L₀, ‖∇L‖²₀ and the batch's CAP (``_begin``).
The weights are moved in place (W₀ is a copy, not a storage swap as in ``teleport.ascent.host``): a
captured graph needs every address fixed.

With ``teleport.hvp: difference`` a tick's U comes from ∇L at a shifted point (``teleport.hvp.difference``): one
more plain forward + backward inside the tick, ε and the shift on the device, the shifted weights in storages
from the allocator (the graph's own pool when captured), so the graph holds no double backward.

A tick computes U whether or not it is used (a refused try's U is dropped): ``where`` chooses, the host
does not. A tick that judges a try no U can follow needs none — the last step's tries, and a try aimed at CAP
(accepted, it ends the batch; refused, it is tried again along the same U), which the status says (``capping``):
eagerly it runs without U (``full=False``), next to a captured full tick from a graph of its own (``_judge``).
A scale-free batch (one step aimed at CAP) replayed is then one full tick and one judging tick, where it was two
full ticks (the trained GPT-style LM of ``benchmarks.lm_trained``: 1,890 kernels a full tick, 611 a judging one, CPU
count). Captured or not, the ticks compute the same thing: without CUDA (or when a model's forward cannot be
captured: a host read inside it) they run eagerly, the tested fallback.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
from torch import Tensor

from teleport.ascent.flat_move import FlatMove
from teleport.ascent.rules import AimScale, aim_on_device, aims_first, shorten_factor
from teleport.config import TeleportConfig
from teleport.hvp.direction import Direction
from teleport.hvp.objective import HostReads, Objective, host_floats

# a tick's verdict on the try it judged, and the reason a teleport stopped (``REASONS``)
OK, CAP, NOT_FINITE, LOSS_TOL, NO_ASCENT = 1, 2, 3, 4, 5
REASONS = ("", "steps", "cap", "not_finite", "loss_tol", "no_ascent")  # by code
WARMUP = 1  # eager ticks on a side stream before the capture (lazy inits: cuBLAS workspaces, autograd streams)

STATUS = ("done", "steps", "pending", "capping", "backoffs", "reason", "loss", "grad_norm_sq", "loss0",
          "grad_norm_sq0")  # a tick's status, in order (L and ‖∇L‖² now, then at the start)
Evaluate = Callable[[bool], tuple[Objective, Tensor]]  # graph? -> (the objective's gradients, [‖∇L‖², L])


def tick_constants(config: TeleportConfig) -> TeleportConfig:
    """The numbers of a config a captured tick holds as constants: all but the steps and CAP, which are state tensors
    (the budget shortens a batch's steps; ``cap_ratio`` gives each batch a CAP of its own), so a tick captured for
    one batch replays for a batch that differs in them."""
    return replace(config, steps=0, cap=1.0)


class Capturing:
    """What a model's device ticks keep from one teleport to the next: the side stream every captured teleport of it
    runs on, per device, and whether its tick could not be captured (its later teleports then do not try again)."""

    def __init__(self) -> None:
        self.streams: dict[int, torch.cuda.Stream] = {}
        self.failed = False

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """One side stream per device for every captured teleport: what a captured tick keeps for later batches (its
        static inputs, state, bases: ``teleport.ascent.graphs``) is allocated and used on one stream, as the caching
        allocator expects of a tensor no ``record_stream`` names."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self.streams:
            self.streams[index] = torch.cuda.Stream(index)
        return self.streams[index]

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The stream the teleport runs on if it is not the device's default stream (``own_stream``), else the
        teleports' own one: a capture cannot be made on the default stream."""
        current = torch.cuda.current_stream(device)
        return self.stream(device) if current == torch.cuda.default_stream(device) else current

    @contextlib.contextmanager
    def own_stream(self, device: torch.device, enabled: bool) -> Iterator[None]:
        """Run the block on a side stream of ``device`` that waits for the caller's stream, and make the caller's
        stream wait for it after (even when the block raises); nothing when not ``enabled``. A teleport to be
        captured runs whole on it: the autograd nodes of its first evaluation (the weights' AccumulateGrad among
        them, shared by every later graph) then belong to the capturing stream, and autograd syncs no other stream
        with it during the capture — on the caller's default stream they made the H200's capture fail. The nodes die
        with the teleport's graphs, so the training step after it makes its own on its stream."""
        if not enabled:
            yield
            return
        caller = torch.cuda.current_stream(device)
        side = self.stream(device)
        side.wait_stream(caller)
        try:
            with torch.cuda.stream(side):
                yield
        finally:
            caller.wait_stream(side)


class DeviceAscent:
    """The t steps of one teleport batch, guard included, as device ticks (see the module)."""

    def __init__(self, weights: list[Tensor], evaluate: Evaluate, direction: Direction, start: Objective,
                 config: TeleportConfig, commit: Callable[[Tensor], None] | None = None,
                 aim: AimScale | None = None) -> None:
        """``start``: the objective at the weights as they are, read (L, ‖∇L‖² < CAP) with its graph: the first
        tick takes step 1's first try from it, evaluating nothing. ``commit``: told after each U whether it starts a
        step (``difference.ShiftScale.commit``: what a difference learned is kept only from the U the host guard
        would have computed too). ``aim``: the model's factor on the aim at CAP, learned from its aimed steps
        (``teleport.ascent.rules``)."""
        self.weights, self.evaluate, self.direction, self.config = weights, evaluate, direction, config
        self.commit, self.aim = commit, aim
        device = weights[0].device
        self.flat = FlatMove(weights)  # W₀ of the step in flight and its U = π(H·∇L), in flat runs
        self.origin, self.u = self.flat.origin, self.flat.u
        f64, i64 = {"dtype": torch.float64, "device": device}, {"dtype": torch.long, "device": device}
        self.first, self.loss0 = torch.zeros(2, **f64), torch.zeros((), **f64)  # [‖∇L‖², L] at the start; L₀
        self.eta = torch.zeros((), **f64)  # η carried from step to step
        self.eta_try = torch.zeros((), **f64)  # η of the try in flight
        self.eta_first = torch.zeros((), **f64)  # η of the first try of the step in flight
        self.slope = torch.zeros((), **f64)  # d‖∇L‖²/dη of the step in flight, 2‖U‖²
        self.gn, self.loss = torch.zeros((), **f64), torch.zeros((), **f64)  # at the last accepted weights
        self.gn0 = torch.zeros((), **f64)  # ‖∇L‖² at the start, as the first tick found it
        self.starting = torch.zeros((), dtype=torch.bool, device=device)  # the next tick is the batch's first
        self.pending, self.aimed, self.capping, self.done = (torch.zeros((), dtype=torch.bool, device=device)
                                                             for _ in range(4))
        self.steps, self.tries, self.backoffs = (torch.zeros((), **i64) for _ in range(3))
        self.reason = torch.zeros((), **i64)
        self.max_steps = torch.zeros((), **i64)  # t: a tensor, not a constant of a captured tick (the budget varies it)
        self.cap = torch.zeros((), **f64)  # CAP: a tensor too (``cap_ratio``: each batch's own)
        self.status = torch.zeros(len(STATUS), **f64)  # what the host reads after a tick, in one copy
        self.graph: torch.cuda.CUDAGraph | None = None  # the full tick, once captured
        self.judge: torch.cuda.CUDAGraph | None = None  # the tick that only judges a try (``_judge``), once captured
        self.warmed = False  # ``run`` ran the full tick eagerly on a side stream: the warm-up of its capture
        self.judging = "cold"  # ``_judge``'s tick next to a graph: "warm" once run eagerly, "eager": its capture failed
        self.capturing = Capturing()  # the side stream of its captures (``run`` sets the model's)
        self.reset(start)

    def reset(self, start: Objective, config: TeleportConfig | None = None) -> None:
        """Start a teleport batch from ``start`` (see ``__init__``), every state tensor set in place: a captured
        tick replays on the same addresses for a later batch (``teleport.ascent.graphs``). ``config`` may change the
        number of steps and CAP only: every other number of it is a constant of a captured tick (``tick_constants``)."""
        if config is not None:
            if tick_constants(config) != tick_constants(self.config):
                raise ValueError("a device ascent is reset with the config it was built with, steps and CAP aside")
            self.config = config
        if self.config.steps < 1 or start.grad_norm_sq >= self.config.cap:  # NaN: deferred to the first tick
            raise ValueError("a device ascent needs teleport.steps >= 1 and ‖∇L‖² below CAP at the start")
        with torch.no_grad():
            torch._foreach_copy_(self.origin, [w.detach() for w in self.weights])  # (U: written as step 1 starts)
            self.first.copy_(torch.tensor([start.grad_norm_sq, start.loss], dtype=torch.float64))
            self.eta.fill_(self.config.lr)
            self.max_steps.fill_(self.config.steps)
            self.cap.fill_(self.config.cap)
            self.starting.fill_(True)
            for t in (self.eta_try, self.eta_first, self.slope, self.gn, self.gn0, self.loss, self.pending, self.aimed,
                      self.capping, self.done, self.steps, self.tries, self.backoffs, self.reason, self.status):
                t.zero_()
        self.start: Objective | None = start
        # the status as last read; before the first tick's is (it is not read: one host read a step), what it will
        # say: step 1 in flight, aimed at CAP where the config always aims it (its next tick judges alone)
        aimed = aims_first(self.config.rise, self.config.cap_ratio)
        self.state = dict.fromkeys(STATUS, 0.0) | {"pending": 1.0, "capping": float(aimed)}
        self.mode = "device" if self.graph is None else "cuda_graph"

    def run(self, graphs: bool, capturing: Capturing | None = None, warm: bool = False,
            reads: HostReads | None = None) -> str:
        """Tick until done; with ``graphs`` (CUDA), after ``WARMUP`` eager ticks the full tick is captured and
        replayed, on the stream the teleport runs on when that is a side stream (``own_stream``), else the teleports'
        own side stream;
        a tick captured for an earlier batch (``self.graph``, ``reset`` since) is replayed from the first tick on (it
        evaluates at W again, inside the graph, rather than an eager tick taking step 1 from ``start``'s graph).
        The first tick needs no read: it starts step 1 (steps ≥ 1, ‖∇L‖² < CAP were checked).
        Until a graph exists the ticks after the start are its warm-up and its capture whatever they judge (a judging
        tick's U is then computed and dropped: the graph is what the model's later batches replay from their first
        tick, a batch of one step included).
        ``capturing`` (the model's): once its tick could not be captured, its later teleports do not try again; the
        side stream its captures run on. ``reads``: counts the host reads (one a tick). ``warm``:
        an earlier batch ran the warm-up (``GraphCache.warmed``): capture at the first full tick after the start;
        ``self.warmed`` says whether this run ran it."""
        graph = self.graph
        capturing = capturing or self.capturing
        self.capturing = capturing
        graphs = graph is not None or (graphs and not capturing.failed)
        side = capturing.side_stream(self.weights[0].device) if graphs and graph is None else None
        limit = self.config.steps * (self.config.max_backoff + 1) + 1  # every try of every step, and the first
        try:
            start, self.start = self.start, None
            assert start is not None, "a device ascent runs once"
            if graph is not None:  # a graph from an earlier batch: it evaluates at W itself, the host only launches
                graph.replay()
            else:
                self.tick(True, (start, self.first))
            ticks = 1
            while not self.state["done"]:
                if ticks >= limit:
                    raise RuntimeError(f"teleport: the device ascent took {ticks} ticks (at most {limit})")
                # no U can follow the try in flight (see ``_judge``): aimed at CAP or shortened under it, or the last
                judging = self.state["pending"] and (self.state["capping"] or
                                                     self.state["steps"] + 1 == self.config.steps)
                if graph is not None:
                    self._judge() if judging else graph.replay()
                elif side is None:
                    self.tick(not judging)
                elif ticks < 1 + WARMUP and not warm:
                    self._on(side, lambda: self.tick(True))
                    self.warmed = True
                else:
                    graph, side = self._capture(side), None
                    self.graph = graph
                    if graph is None:
                        capturing.failed = True
                    graph.replay() if graph is not None else self.tick(True)
                ticks += 1
                self.state = dict(zip(STATUS, host_floats(self.status, reads), strict=True))
        except BaseException:
            self.abandon()
            raise
        return REASONS[int(self.state["reason"])]

    def tick(self, full: bool, given: tuple[Objective, Tensor] | None = None) -> None:
        """Evaluate at W (or take the ``given`` evaluation), judge the try in flight, move: every branch a
        ``where`` (see the module)."""
        obj, scalars = given or self.evaluate(full)
        with torch.no_grad():
            gn, loss = scalars[0], scalars[1]
            c = self.config
            live = ~self.done
            self._begin(live & self.starting, gn, loss)
            verdict = self._verdict(gn, loss)
            accept = live & self.pending & (verdict == OK)
            reject = live & self.pending & (verdict != OK)
            failed = self.tries + reject.long()  # failed tries of the step in flight
            exhausted = reject & (failed > c.max_backoff)
            retry = reject & ~exhausted
            ended_cap = accept & self.capping  # accepted once shortened to fit under CAP: CAP is reached
            if self.aim is not None:  # an aimed step that landed teaches the model's next aim
                self.aim.learn(ended_cap & self.aimed, self.eta_first, self.eta_try, gn - self.gn, self.cap - self.gn)
            eta = torch.where(accept & ~self.aimed, self.eta_try, self.eta)
            here = accept | (live & ~self.pending)  # W is an accepted point: its L and ‖∇L‖² are the current ones
            gn_now, loss_now = torch.where(here, gn, self.gn), torch.where(here, loss, self.loss)
            steps = self.steps + accept.long()
            free = here & ~ended_cap  # nothing in flight: a new step, or the end
            finished = free & (steps >= self.max_steps)
            at_cap = free & ~finished & (gn_now >= self.cap)
            broken = free & ~(torch.isfinite(gn_now) & torch.isfinite(loss_now))  # only a deferred start sees it
            start = free & ~finished & ~at_cap & ~broken
            u_new = self.direction(obj) if full else self.u
            if full and self.commit is not None:
                self.commit(start)
            aimed_eta, aimed, slope = aim_on_device(eta, gn_now, u_new, self.cap, c.rise, self.aim)
            factor = self._shorten(verdict, gn, gn_now)
            eta_try = torch.where(start, aimed_eta, torch.where(retry, self.eta_try * factor, self.eta_try))
            self.flat.move(start, retry, exhausted, eta_try, u_new)  # W₀, U and W: ``teleport.ascent.flat_move``
            reason = torch.where(exhausted, verdict, self.reason)
            reason = torch.where(ended_cap | at_cap, CAP, torch.where(finished, OK, reason))
            reason = torch.where(broken, NOT_FINITE, reason)
            done = self.done | exhausted | ended_cap | at_cap | finished | broken
            backoffs = self.backoffs + reject.long()
            capping = torch.where(start, aimed, torch.where(retry, verdict == CAP, self.capping))
            for state, value in ((self.eta, eta), (self.eta_try, eta_try),
                                 (self.eta_first, torch.where(start, eta_try, self.eta_first)),
                                 (self.slope, torch.where(start, slope, self.slope)),
                                 (self.gn, gn_now), (self.loss, loss_now),
                                 (self.steps, steps), (self.backoffs, backoffs),
                                 (self.tries, torch.where(start, 0, failed)), (self.reason, reason),
                                 (self.aimed, torch.where(start, aimed, self.aimed)),
                                 (self.capping, capping), (self.pending, start | retry), (self.done, done)):
                state.copy_(value)
            self.status.copy_(torch.stack([done, steps, start | retry, capping, backoffs, reason, loss_now, gn_now,
                                           self.loss0, self.gn0]).double())

    def _begin(self, first: Tensor, gn: Tensor, loss: Tensor) -> None:
        """The batch's first tick (``first``) sets what the start decides: L₀, ‖∇L‖²₀ and the batch's CAP
        (``TeleportConfig.for_batch``: min(CAP, cap_ratio·‖∇L‖²₀) where 0 < ‖∇L‖²₀ < ∞). A start read on the host
        (``reset``'s) gives the same numbers again; a start deferred to this tick (a replayed graph's batch,
        ``teleport.teleporter``) gets them here, on the device."""
        self.loss0.copy_(torch.where(first, loss, self.loss0))
        self.gn0.copy_(torch.where(first, gn, self.gn0))
        ratio = self.config.cap_ratio
        if ratio is not None:
            own = first & (gn > 0) & torch.isfinite(gn)
            self.cap.copy_(torch.where(own, torch.minimum(self.cap, ratio * gn), self.cap))
        self.starting.copy_(self.starting & ~first)

    def _verdict(self, gn: Tensor, loss: Tensor) -> Tensor:
        """``rules.step_verdict`` on the device: OK, or the first rule the try breaks."""
        c = self.config
        tol = c.loss_tol * self.loss0.abs().clamp_min(1e-12)
        code = torch.where(gn < self.gn, NO_ASCENT, OK)
        code = torch.where((loss - self.loss0).abs() > tol, LOSS_TOL, code)
        code = torch.where(gn > self.cap, CAP, code)
        return torch.where(torch.isfinite(gn) & torch.isfinite(loss), code, NOT_FINITE)

    def _shorten(self, verdict: Tensor, after: Tensor, before: Tensor) -> Tensor:
        """``rules.shorten`` on the device: ``shorten_factor`` for a CAP overshoot of the try in flight, else ½."""
        factor = shorten_factor(after, before, self.cap, self.slope * self.eta_try)
        return torch.where((verdict == CAP) & (after > before), factor, 0.5)

    def _judge(self) -> None:
        """A tick next to the full tick's graph that only judges the try in flight: no U can follow it, since the try,
        accepted, ends the batch (aimed at CAP, or the last step's) and, refused, is tried again along the same U. It
        has a graph of its own, a forward and a backward where the full tick adds the double backward and the
        projection (a scale-free batch: one full tick, one judging tick). The first runs eagerly on the stream its
        capture will use (the warm-up of the plain backward), the next captures it, later ones replay it; a capture
        that fails leaves them eager (the full tick's graph is kept). Its memory pool is its own, as the full
        tick's is."""
        side = self.capturing.side_stream(self.weights[0].device)
        if self.judge is None and self.judging == "warm":
            self.judge = self._capture(side, full=False)
            self.judging = "warm" if self.judge is not None else "eager"
        if self.judge is not None:
            self.judge.replay()
            return
        self._on(side, lambda: self.tick(False))
        self.judging = "warm" if self.judging == "cold" else self.judging

    def _capture(self, side: torch.cuda.Stream, full: bool = True) -> torch.cuda.CUDAGraph | None:
        """The full tick (``full``; else the judging tick, ``_judge``) as a CUDA graph (nothing runs while it is
        captured), or None, with a warning, when the model's forward cannot be captured: the ticks then go on
        eagerly. Not ``torch.cuda.graph``: that empties
        the allocator's cache at every capture, and the training step after the teleport would pay to refill it.
        Capture mode "thread_local": a call another thread of the process makes meanwhile (a DataLoader's pin-memory
        thread allocating pinned memory, a user's own thread) is not an error there; anything that touches the
        capturing stream (autograd's device thread runs the backward on it) still fails the capture."""
        graph = torch.cuda.CUDAGraph()
        side.wait_stream(torch.cuda.current_stream())
        device = self.weights[0].device
        generator = torch.cuda.default_generators[torch.cuda.current_device() if device.index is None else device.index]
        before = generator.clone_state()  # capture_begin registers it; a failed capture never releases it
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self.tick(full)
                finally:
                    with contextlib.suppress(RuntimeError):  # an invalidated capture: the tick's error says why
                        graph.capture_end()
        except RuntimeError as err:
            generator.graphsafe_set_state(before)  # else every later CUDA random draw raises (seen on an H200)
            what = "the ascent step" if full else "the tick that judges a try"
            until = "for this model from now on" if full else "for this model's graph"
            warnings.warn(f"teleport: {what} could not be captured in a CUDA graph, it runs eagerly, {until} "
                          f"({str(err).splitlines()[0]})", RuntimeWarning, stacklevel=3)
            return None
        finally:
            torch.cuda.current_stream().wait_stream(side)
        self.mode = "cuda_graph"
        return graph

    @staticmethod
    def _on(side: torch.cuda.Stream, fn: Callable[[], None]) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)

    def abandon(self) -> None:
        """A tick raised: the try in flight is dropped, W is W₀ (the last accepted weights)."""
        with torch.no_grad():
            for w, origin in zip(self.weights, self.origin, strict=True):
                w.copy_(torch.where(self.pending, origin, w))

    def result(self) -> tuple[int, int, float, float]:
        """(steps, back-offs, L, ‖∇L‖²) at the last accepted weights, from the last status read."""
        st = self.state
        return int(st["steps"]), int(st["backoffs"]), st["loss"], st["grad_norm_sq"]

    def started(self) -> tuple[float, float]:
        """(L, ‖∇L‖²) at the start, as the first tick found them."""
        return self.state["loss0"], self.state["grad_norm_sq0"]
