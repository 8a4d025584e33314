"""One captured tick, reused by later teleport batches and teleports of the same model (``ascent: cuda_graph``).

A graph captured per teleport batch pays an eager warm-up tick and the capture before its first replay: for a
batch of 8 steps that is most of its ticks, and the capture costs about what an eager tick does. A CUDA graph
replays its kernels on the addresses it was captured with, so it can serve a later batch when every tensor a tick
reads is where it was, with the shape it had:

- the batch: every evaluation of a captured teleport reads the model's *static inputs*, into which each new batch
  of the same shape is copied (``static_inputs``);
- the parameters: their storages unchanged since the capture (the optimizer steps in place), read through the
  aliases the model's captured teleports differentiate by (``own_leaves``), kept while they share those storages;
- the moving blocks' bias-row maps, row classes (their rows, or the mask of a tied LM's head rows no lookup fixes)
  and bases (``_slots``): the new batch's values copied into the captured tensors, each kept basis padded to its
  R's column count (``blocks.fixed_widths``: a batch whose rank differs keeps the shapes);
- the ascent's state: ``DeviceAscent.reset`` sets it in place;
- the config and the loss function: their numbers are constants of the graph — all but the steps and CAP, state
  tensors (the budget shortens a batch's steps, ``cap_ratio`` gives each batch its own CAP: such a batch replays the
  same graph; ``device.tick_constants``).

``key`` names all of it; an equal key replays every tick of the batch (``reused``; ``DeviceAscent.run``) — the first
tick reads the batch's start itself, so such a batch's setup is a forward that records the uses (``may_replay``;
``teleport.teleporter``) — anything else captures anew and replaces the entry (``keep``): one graph a model, its
memory pool held until then or until ``release``. A batch whose row classes differ (masks in the data, say), or whose
rank differs on the ``gram`` route (more columns than inputs: the side kept is the smaller), captures again.

A ``GraphCache`` belongs to one model's ``Teleporter``: it is that model's state, not the process'. Its captured
closures reach the model through a weak reference, so the graph never keeps a model alive.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from teleport.ascent.device import Capturing, DeviceAscent, tick_constants
from teleport.ascent.run import AscentBatch, Evaluate, Tensors
from teleport.config import TeleportConfig
from teleport.geometry.blocks import Block
from teleport.hvp.objective import Objective

CHURN = 3  # teleport batches in a row that each captured a graph of their own: the model's shapes keep changing


@dataclass
class Entry:
    x: Tensor  # the static inputs every evaluation of a captured teleport reads
    y: Tensor
    key: tuple | None = None  # what the graph was captured for
    blocks: list[Block] | None = None  # the moving blocks whose tensors the graph reads
    ascent: DeviceAscent | None = None  # its state tensors, its graph
    warm: tuple | None = None  # the key whose full tick has run eagerly on the teleports' stream: a capture's warm-up


def _still_aliases(alias: nn.Parameter, p: Tensor) -> bool:
    return (alias.data_ptr(), alias.shape, alias.stride(), alias.dtype, alias.device, alias.requires_grad) == (
        p.data_ptr(), p.shape, p.stride(), p.dtype, p.device, p.requires_grad)


def _like(t: Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.dtype, t.device)


def _slots(blocks: list[Block]) -> tuple[list[Tensor | None], list[tuple]]:
    """The tensors of the moving blocks a tick reads, in a fixed order, and what decides the tick's Python path
    (which weights, layouts, how many classes, which classes share a basis, the ranks)."""
    tensors: list[Tensor | None] = []
    path: list[tuple] = []
    shared: dict[int, int] = {}
    for b in blocks:
        tensors += [b.bias_rows, *(b._bias_index or (None, None))]
        path.append((id(b.weight), None if b.bias is None else id(b.bias), b.layout, len(b.classes),
                     b.reads_fixed_inputs, tuple(p.kind for p in b.parts)))
        for cls in b.classes:
            assert cls.basis is not None
            basis = cls.basis
            path.append((shared.setdefault(id(basis), len(shared)), basis.dim, basis.rank > 0, basis.route))
            tensors += [cls.rows, cls.mask, basis.kept, basis.free]
    return tensors, path


def key(config: TeleportConfig, loss_fn: Callable, params: list[Tensor], blocks: list[Block]) -> tuple:
    """Everything a captured tick depends on besides the values ``reused`` copies in."""
    tensors, path = _slots(blocks)
    return (tick_constants(config), id(loss_fn), tuple((id(p), p.data_ptr(), _like(p)) for p in params),
            tuple(_like(t) for t in tensors), tuple(path))


class GraphCache:
    """One model's captured tick and what it reads (see the module), its capture stream, and the churn streak."""

    def __init__(self) -> None:
        self.entry: Entry | None = None
        self.fresh = 0  # teleport batches in a row that each captured a graph of their own
        self.leaves: dict[int, tuple[Tensor, nn.Parameter]] = {}  # id(parameter) -> (it, its alias): ``own_leaves``
        self.capturing = Capturing()  # the side stream, and whether the model's tick could not be captured

    def static_inputs(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """(x, y) copied into the model's static inputs; new ones — and no graph — when their shapes differ."""
        entry = self.entry
        if entry is None or (_like(entry.x), _like(entry.y)) != (_like(x), _like(y)):
            entry = self.entry = Entry(x.detach().clone(), y.detach().clone())
        else:
            entry.x.copy_(x)
            entry.y.copy_(y)
        return entry.x, entry.y

    def may_replay(self) -> bool:
        """Whether the model holds a captured tick for static inputs of this batch's shapes (``static_inputs`` ran):
        its key is known only once the batch's blocks are (``reused``)."""
        entry = self.entry
        return entry is not None and entry.ascent is not None and entry.ascent.graph is not None

    def reused(self, graph_key: tuple, blocks: list[Block], start: Objective,
               config: TeleportConfig) -> DeviceAscent | None:
        """The model's captured ascent, its blocks' tensors holding this batch's values and its state reset to
        ``start`` and ``config`` (whose steps may differ: the budget shortens batches), when it was captured for
        ``graph_key``; else None."""
        entry = self.entry
        if entry is None or entry.ascent is None or entry.ascent.graph is None or entry.key != graph_key:
            return None
        assert entry.blocks is not None
        with torch.no_grad():
            for old, new in zip(_slots(entry.blocks)[0], _slots(blocks)[0], strict=True):
                if old is not None and new is not None and old is not new:
                    old.copy_(new)
        entry.ascent.reset(start, config)
        return entry.ascent

    def keep(self, graph_key: tuple, blocks: list[Block], ascent: DeviceAscent) -> None:
        """Keep a freshly captured ascent for the model's later batches (its static inputs are the entry's)."""
        if self.entry is not None and ascent.graph is not None:
            self.entry.key, self.entry.blocks, self.entry.ascent = graph_key, blocks, ascent

    def warmed(self, graph_key: tuple) -> bool:
        """Whether an earlier batch ran the full tick for ``graph_key`` eagerly on the teleports' stream (the warm-up
        a capture needs: ``DeviceAscent.run``), so this batch may capture at its first full tick after the start.
        A batch of two ticks (the start's, and the one judging a step that lands at its first try) would otherwise
        spend its second on a warm-up every time and never be captured."""
        return self.entry is not None and self.entry.warm == graph_key

    def warm(self, graph_key: tuple) -> None:
        """The full tick for ``graph_key`` has run eagerly on the teleports' stream (see ``warmed``)."""
        if self.entry is not None:
            self.entry.warm = graph_key

    def counted(self, replayed: bool) -> None:
        """A teleport batch ran from a CUDA graph: replayed from an earlier batch's, or captured for itself. The
        ``CHURN``-th capture in a row drops the graph (``release``): a batch of new shapes each time (an LM's
        batches padded to their longest sequence) gains nothing from a graph it cannot replay — its warm-up tick,
        the capture and a graph's memory pool each batch — and ``auto`` runs the model's later batches by the host
        guard (``churning``)."""
        self.fresh = 0 if replayed else self.fresh + 1
        if self.fresh >= CHURN:
            self.release()

    @property
    def churning(self) -> bool:
        """Whether the model's last ``CHURN`` captured teleport batches each captured a graph of their own."""
        return self.fresh >= CHURN

    def release(self) -> None:
        """Drop the captured graph, its memory pool, static inputs and parameter aliases (a later teleport captures
        anew)."""
        self.entry, self.leaves = None, {}

    @contextlib.contextmanager
    def own_leaves(self, model: nn.Module, enabled: bool = True) -> Iterator[None]:
        """Inside the block the model's parameters are aliases of them: other leaf tensors on the same storages (a move
        of an alias moves the parameter), put back after, even when the block raises; nothing when not ``enabled``.

        A captured teleport differentiates by leaves of its own. A parameter's AccumulateGrad node is made once and
        kept while anything holds it: the graph of a training step's loss a loop still holds, DDP's reducer. It
        belongs to the stream it was made on — the default stream — and a backward captured on a side stream that
        reaches it makes the default stream wait on the capturing one: the capture fails ("operation would make the
        legacy stream depend on a capturing blocking stream", the H200's failure; torch warns that "the AccumulateGrad
        node's stream does not match"). An alias' node is made by the teleport's first evaluation, on the teleport's
        stream (``own_stream``), and dies with its graphs. The aliases are kept for the model's later teleports while
        they still share their parameter's storage and layout, so a captured graph's key (``key``: the parameters'
        ids) stays equal. The alias is set as each module's attribute (``setattr``: an RNN's flat weights follow): a
        forward that reaches a parameter some other way (a list of its own) uses the parameter, which the teleport
        then neither differentiates nor moves.
        """
        if not enabled:
            yield
            return
        kept = self.leaves
        now: dict[int, tuple[Tensor, nn.Parameter]] = {}
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        try:
            for module in model.modules():
                for name, p in list(module._parameters.items()):
                    if p is None:
                        continue
                    if id(p) not in now:
                        old = kept.get(id(p))
                        reuse = old is not None and old[0] is p and _still_aliases(old[1], p)
                        now[id(p)] = (p, old[1] if reuse else nn.Parameter(p.detach(), requires_grad=p.requires_grad))
                    setattr(module, name, now[id(p)][1])
                    swapped.append((module, name, p))
            self.leaves = now
            yield
        finally:
            for module, name, p in reversed(swapped):
                setattr(module, name, p)


class DeviceTicks:
    """The batch's steps as device ticks (``teleport.ascent.device``) — an ``Ascent``; with ``graphed`` (mode
    "cuda_graph") captured in a CUDA graph that the model's later batches replay (``cache``, the model's)."""

    def __init__(self, cache: GraphCache, graphed: bool) -> None:
        self.cache = cache
        # a model whose tick could not be captured has no static inputs (``Teleporter``): never replayed
        self.graphed = graphed and not cache.capturing.failed

    def __call__(self, batch: AscentBatch, evaluate: Evaluate, tensors: Tensors) -> str:
        cache, graphed = self.cache, self.graphed
        direction = batch.direction(None)  # the ticks are single-process
        graph_key = key(batch.config, batch.loss_fn, batch.params, batch.blocks) if graphed else ()
        ascent = cache.reused(graph_key, batch.blocks, batch.cur, batch.config) if graphed else None
        if ascent is None and (reason := batch.undefer(evaluate)):  # no graph serves the batch after all
            return reason
        fresh = ascent is None
        batch.graph_replayed = not fresh
        commit = batch.scale.commit if batch.scale is not None else None
        ascent = ascent or DeviceAscent(batch.weights, tensors, direction, batch.cur, batch.config, commit, batch.aim)
        reason = ascent.run(graphs=graphed, capturing=cache.capturing, warm=graphed and cache.warmed(graph_key),
                            reads=batch.reads)
        if graphed and fresh:
            cache.keep(graph_key, batch.blocks, ascent)
            if ascent.warmed:
                cache.warm(graph_key)
        if graphed and ascent.graph is not None:
            cache.counted(replayed=not fresh)
        if cache.capturing.failed:
            cache.release()  # a graph kept for an earlier batch must not serve a later one
        batch.ascent = ascent.mode  # "device" when the capture failed
        batch.steps, batch.backoffs, loss, gn = ascent.result()
        batch.cur = replace(batch.cur, loss=loss, grad_norm_sq=gn)
        if batch.deferred:  # the first replayed tick read the start
            batch.started(*ascent.started())
        return reason
