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
  same graph; ``on_device.tick_constants``).

``key`` names all of it; an equal key replays every tick of the batch (``reused``; ``DeviceAscent.run``) — the first
tick reads the batch's start itself, so such a batch's setup is a forward that records the uses (``may_replay``;
``teleport.nullspace``) — anything
else captures anew and replaces the model's entry (``keep``): one graph a model, its memory pool held until then or
until ``release``. A batch whose row classes differ (masks in the data, say), or whose rank differs on the ``gram``
route (more columns than inputs: the side kept is the smaller), captures again. The entry holds the model only
weakly (the captured closures reach it through a weak reference), so it dies with it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from teleport.blocks import Block
from teleport.objective import Objective
from teleport.on_device import DeviceAscent, tick_constants
from teleport.report import TeleportConfig


@dataclass
class Entry:
    x: Tensor  # the static inputs every evaluation of a captured teleport reads
    y: Tensor
    key: tuple | None = None  # what the graph was captured for
    blocks: list[Block] | None = None  # the moving blocks whose tensors the graph reads
    ascent: DeviceAscent | None = None  # its state tensors, its graph
    warm: tuple | None = None  # the key whose full tick has run eagerly on the teleports' stream: a capture's warm-up


ENTRIES: weakref.WeakKeyDictionary[nn.Module, Entry] = weakref.WeakKeyDictionary()
CHURN = 3  # teleport batches in a row that each captured a graph of their own: the model's shapes keep changing
_FRESH: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()  # model -> that streak
# model -> id(parameter) -> (the parameter, its alias): the aliases a captured teleport of the model differentiates by
LEAVES: weakref.WeakKeyDictionary[nn.Module, dict[int, tuple[Tensor, nn.Parameter]]] = weakref.WeakKeyDictionary()


def _like(t: Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.dtype, t.device)


def static_inputs(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """(x, y) copied into the model's static inputs; new ones — and no graph — when their shapes differ."""
    entry = ENTRIES.get(model)
    if entry is None or (_like(entry.x), _like(entry.y)) != (_like(x), _like(y)):
        entry = ENTRIES[model] = Entry(x.detach().clone(), y.detach().clone())
    else:
        entry.x.copy_(x)
        entry.y.copy_(y)
    return entry.x, entry.y


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


def may_replay(model: nn.Module) -> bool:
    """Whether the model holds a captured tick for static inputs of this batch's shapes (``static_inputs`` ran):
    its key is known only once the batch's blocks are (``reused``)."""
    entry = ENTRIES.get(model)
    return entry is not None and entry.ascent is not None and entry.ascent.graph is not None


def reused(model: nn.Module, graph_key: tuple, blocks: list[Block], start: Objective,
           config: TeleportConfig) -> DeviceAscent | None:
    """The model's captured ascent, its blocks' tensors holding this batch's values and its state reset to
    ``start`` and ``config`` (whose steps may differ: the budget shortens batches), when it was captured for
    ``graph_key``; else None."""
    entry = ENTRIES.get(model)
    if entry is None or entry.ascent is None or entry.ascent.graph is None or entry.key != graph_key:
        return None
    assert entry.blocks is not None
    with torch.no_grad():
        for old, new in zip(_slots(entry.blocks)[0], _slots(blocks)[0], strict=True):
            if old is not None and new is not None and old is not new:
                old.copy_(new)
    entry.ascent.reset(start, config)
    return entry.ascent


def keep(model: nn.Module, graph_key: tuple, blocks: list[Block], ascent: DeviceAscent) -> None:
    """Keep a freshly captured ascent for the model's later batches (its static inputs are the entry's)."""
    entry = ENTRIES.get(model)
    if entry is not None and ascent.graph is not None:
        entry.key, entry.blocks, entry.ascent = graph_key, blocks, ascent


def warmed(model: nn.Module, graph_key: tuple) -> bool:
    """Whether an earlier batch of the model ran its full tick for ``graph_key`` eagerly on the teleports' stream (the
    warm-up a capture needs: ``DeviceAscent.run``), so this batch may capture at its first full tick after the start.
    A batch of two ticks (the start's, and the one judging a step that lands at its first try) would otherwise spend
    its second on a warm-up every time and never be captured."""
    entry = ENTRIES.get(model)
    return entry is not None and entry.warm == graph_key


def warm(model: nn.Module, graph_key: tuple) -> None:
    """The model's full tick for ``graph_key`` has run eagerly on the teleports' stream (see ``warmed``)."""
    entry = ENTRIES.get(model)
    if entry is not None:
        entry.warm = graph_key


def counted(model: nn.Module, replayed: bool) -> None:
    """A teleport batch of the model ran from a CUDA graph: replayed from an earlier batch's, or captured for itself.
    The ``CHURN``-th capture in a row drops the graph (``release``): a batch of new shapes each time (an LM's
    batches padded to their longest sequence) gains nothing from a graph it cannot replay — its warm-up tick, the
    capture and a graph's memory pool each batch — and ``auto`` runs the model's later batches by the host guard
    (``churning``)."""
    streak = _FRESH[model] = 0 if replayed else _FRESH.get(model, 0) + 1
    if streak >= CHURN:
        release(model)


def churning(model: nn.Module) -> bool:
    """Whether the model's last ``CHURN`` captured teleport batches each captured a graph of their own."""
    return _FRESH.get(model, 0) >= CHURN


def release(model: nn.Module) -> None:
    """Drop the model's captured graph, its memory pool, static inputs and parameter aliases (a later teleport
    captures anew)."""
    ENTRIES.pop(model, None)
    LEAVES.pop(model, None)


def _still_aliases(alias: nn.Parameter, p: Tensor) -> bool:
    return (alias.data_ptr(), alias.shape, alias.stride(), alias.dtype, alias.device, alias.requires_grad) == (
        p.data_ptr(), p.shape, p.stride(), p.dtype, p.device, p.requires_grad)


@contextlib.contextmanager
def own_leaves(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside the block the model's parameters are aliases of them: other leaf tensors on the same storages (a move
    of an alias moves the parameter), put back after, even when the block raises; nothing when not ``enabled``.

    A captured teleport differentiates by leaves of its own. A parameter's AccumulateGrad node is made once and kept
    while anything holds it: the graph of a training step's loss a loop still holds, DDP's reducer. It belongs to the
    stream it was made on — the default stream — and a backward captured on a side stream that reaches it makes the
    default stream wait on the capturing one: the capture fails ("operation would make the legacy stream depend on a
    capturing blocking stream", the H200's failure; torch warns that "the AccumulateGrad node's stream does not
    match"). An alias' node is made by the teleport's first evaluation, on the teleport's stream (``own_stream``), and
    dies with its graphs. The aliases are kept for the model's later teleports while they still share their
    parameter's storage and layout, so a captured graph's key (``key``: the parameters' ids) stays equal. The alias is
    set as each module's attribute (``setattr``: an RNN's flat weights follow): a forward that reaches a parameter
    some other way (a list of its own) uses the parameter, which the teleport then neither differentiates nor moves.
    """
    if not enabled:
        yield
        return
    kept = LEAVES.get(model, {})
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
        LEAVES[model] = now
        yield
    finally:
        for module, name, p in reversed(swapped):
            setattr(module, name, p)
