"""From recorded uses to what moves: per weight, the rows that share one null space, and π on them.

A *block* is a weight and the bias added to its rows, moved as the matrix ``[W | b]`` laid out
(rows, C + 1). Each use of some rows is a Part with input columns X. Rows are grouped into
*classes* by the set of uses that read them; a class's representation stacks all of them,

    R_class = [X_use1 | X_use2 | ...]     (with a row of ones under X where the use adds the bias,
                                           zeros where it does not)

so its null space is the intersection of every use's (a weight used twice, a Linear in a loop,
a tied LM head). Rows an embedding lookup reads, and rows no linear map reads, stay fixed.
Parameters that cannot be expressed so are left exactly as they are, each with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from teleport.geometry.capture import Uses
from teleport.geometry.projection import Basis, project_split
from teleport.geometry.uses import Part, Unsupported, arange_index
from teleport.report import LayerReport


@dataclass
class RowClass:
    """Layout rows read by exactly the same uses (None: all rows), and their basis once computed. ``mask``: the
    rows of a class that every use reads whole but an embedding lookup fixes some of (a tied LM's head): all rows
    are projected and the fixed ones zeroed — the same shapes whatever rows a batch looks up, so a captured tick
    serves the next batch (``teleport.ascent.graphs``)."""

    rows: Tensor | None
    parts: list[Part]
    basis: Basis | None = None
    mask: Tensor | None = None  # (rows,) bool, with ``rows`` None: the rows of the class
    columns: int = 0  # N, the columns of the class' R, once its basis is computed

    def key(self, has_bias: bool, bias_id: int | None) -> tuple:
        """Equal keys, equal R: one basis serves every class with the key (Q, K, V on one input)."""
        return (has_bias, *((p.key, p.bias is not None and p.bias == bias_id) for p in self.parts))


@dataclass
class Block:
    """One weight (and its bias) as a (rows, C[+1]) matrix in its layout, with the uses of its rows."""

    name: str
    weight: Tensor
    bias: Tensor | None
    layout: str  # "natural" | "transposed"
    bias_rows: Tensor | None  # (rows,) the bias element of each row, -1 for none; None: row r <-> element r
    parts: list[Part]
    frozen: Tensor | None  # (rows,) bool: rows an embedding lookup reads
    bias_id: int | None = None  # the bias' index among the recorded parameters
    classes: list[RowClass] = field(default_factory=list)
    _bias_index: tuple[Tensor, Tensor] | None = field(default=None, repr=False)  # rows with a bias, their elements

    def __post_init__(self) -> None:
        if self.bias_rows is not None:  # found once, here (a mask's nonzero reads the device): a step reads nothing
            rows = (self.bias_rows >= 0).nonzero().squeeze(1)
            self._bias_index = rows, self.bias_rows[rows]

    @property
    def params(self) -> list[Tensor]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    @property
    def reads_fixed_inputs(self) -> bool:
        """Every use reads inputs no trainable parameter influences (see ``moving_blocks``)."""
        return all(p.fixed_input for p in self.parts)

    @property
    def rows(self) -> int:
        return self.weight.shape[0] if self.layout == "natural" else self.weight.shape[1]

    def matrix(self, g: Tensor) -> Tensor:
        """A tensor of the weight's shape as its layout (rows, C): a view."""
        return g.reshape(self.rows, -1) if self.layout == "natural" else g.T

    def unmatrix(self, m: Tensor) -> Tensor:
        return m.reshape(self.weight.shape) if self.layout == "natural" else m.T

    def augmented(self) -> Tensor:
        """[W | b] in the layout, (rows, C[+1]): ``augmented()[rows] @ representation(cls)`` is the output."""
        w = self.matrix(self.weight.detach())
        if self.bias is None:
            return w.clone()
        return torch.cat([w, self.bias_per_row(self.bias.detach())[:, None]], dim=1)

    def representation(self, cls: RowClass) -> Tensor:
        """R of one class: (C[+1], N), the columns of every use of its rows."""
        blocks = []
        for p in cls.parts:
            x = p.columns()
            if self.bias is not None:
                x = torch.cat([x, (x.new_ones if p.bias == self.bias_id else x.new_zeros)(1, x.shape[1])])
            blocks.append(x)
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)

    def projected(self, grads: list[Tensor], inplace: bool = False) -> list[Tensor]:
        """π applied class by class to [∇W | ∇b]; rows outside every class (fixed rows) get 0.

        ``inplace``: ``grads`` may be overwritten (fresh gradients nobody else holds)."""
        gw = self.matrix(grads[0])  # (rows, C)
        gb = self.bias_per_row(grads[1]) if self.bias is not None else None
        whole = len(self.classes) == 1 and self.classes[0].rows is None
        uw = None if whole else torch.zeros_like(gw)
        ub = None if whole or gb is None else torch.zeros_like(gb)
        for cls in self.classes:
            assert cls.basis is not None
            w = gw if cls.rows is None else gw[cls.rows]
            b = None if gb is None else (gb if cls.rows is None else gb[cls.rows])
            pw, pb = _project(w, b, cls.basis, inplace)
            if cls.mask is not None:  # a where, not a product: a row that overflowed is zeroed too
                pw = torch.where(cls.mask[:, None], pw, 0.0)
                pb = None if pb is None else torch.where(cls.mask, pb, 0.0)
            if whole:
                uw, ub = pw, pb
            else:
                assert uw is not None
                uw[cls.rows] = pw
                if ub is not None and pb is not None:
                    ub[cls.rows] = pb
        assert uw is not None
        out = [self.unmatrix(uw)]
        if self.bias is not None:
            assert ub is not None
            out.append(self.bias_from_rows(ub))
        return out

    def bias_per_row(self, gb: Tensor) -> Tensor:
        flat = gb.reshape(-1)
        if self.bias_rows is None:
            return flat
        valid = self.bias_rows >= 0
        return torch.where(valid, flat[self.bias_rows.clamp_min(0)], flat.new_zeros(()))

    def bias_from_rows(self, ub: Tensor) -> Tensor:
        assert self.bias is not None
        if self.bias_rows is None:
            return ub.reshape(self.bias.shape)
        assert self._bias_index is not None
        rows, elements = self._bias_index
        out = ub.new_zeros(self.bias.numel())
        out[elements] = ub[rows]
        return out.reshape(self.bias.shape)

    def reports(self) -> list[LayerReport]:
        out = []
        for cls in self.classes:
            assert cls.basis is not None
            b, name = cls.basis, self.name
            if cls.mask is not None:
                name += f"[{int(cls.mask.sum())} rows]"
            elif cls.rows is not None:
                r = cls.rows
                contiguous = bool((r[1:] - r[:-1] == 1).all()) if len(r) > 1 else True
                name += f"[rows {int(r[0])}:{int(r[-1]) + 1}]" if contiguous else f"[{len(r)} rows]"
            kind = "+".join(sorted({p.kind for p in cls.parts}))
            out.append(LayerReport(name, kind, b.dim, b.rank, b.free_dims, b.captured_variance))
        return out


def moving_blocks(blocks: list[Block], tau: float, rule: str) -> list[Block]:
    """The blocks a step differentiates, projects and moves: a free direction in some class, and — at
    exact τ = 1 — some use whose input a trainable parameter shapes.

    A weight whose every use reads inputs no trainable parameter influences (the first layer reads
    the data) enters ½‖∇L‖² only through its outputs Z = W X: its teleport gradient (∂/∂Z)·Xᵀ lies in
    the span of its inputs, so π of it is 0 up to rounding (and up to directions below the rank
    tolerance, which the inputs barely reach). Differentiating and projecting it would cost a step of
    an MLP [1024, 1024] on 784 inputs ~40 % of its projection, to move it by round-off.
    """
    exact = tau >= 1.0 and rule == "numerical_rank"
    return [b for b in blocks if any(c.basis is not None and c.basis.free_dims for c in b.classes)
            and not (exact and b.reads_fixed_inputs)]


def linear_only(blocks: list[Block]) -> dict[int, int | None]:
    """id(W) -> id(its bias) (None: no bias) of the blocks whose weight is used by F.linear alone, whole.

    The second backward may take such a weight's H·∇L through its backward alias alone, and leave
    its bias at 0 (``teleport.hvp.spanfree``): exact τ = 1 only.
    """
    return {id(b.weight): None if b.bias is None else id(b.bias) for b in blocks
            if b.frozen is None and all(p.kind == "linear" and p.rows is None for p in b.parts)}


def _project(gw: Tensor, gb: Tensor | None, basis: Basis, inplace: bool) -> tuple[Tensor, Tensor | None]:
    """project_split in the basis' precision (float32 at least), returned in the gradient's dtype."""
    vectors = basis.kept if basis.kept is not None else basis.free
    dtype = gw.dtype if vectors is None else vectors.dtype
    if gw.dtype == dtype:
        return project_split(gw, gb, basis, inplace)
    uw, ub = project_split(gw.to(dtype), None if gb is None else gb.to(dtype), basis, inplace=True)
    return uw.to(gw.dtype), None if ub is None else ub.to(gw.dtype)


# ------------------------------------------------------------------ building blocks from uses


def build_blocks(uses: Uses) -> tuple[list[Block], dict[str, str]]:
    """Blocks of the weights that can move, and why every other trainable parameter stays."""
    reasons = {uses.names[i]: why for i, why in uses.reasons.items()}
    blocks: list[Block] = []
    biases: dict[int, int] = {}  # bias param -> its weight
    for b, weights in uses.bias_of.items():
        name = uses.names[b]
        if len(weights) > 1:
            reasons.setdefault(name, "the bias of several weights (not supported)")
        elif b in uses.parts or b in uses.frozen:
            reasons.setdefault(name, "used as a bias and as a weight")
        else:
            biases[b] = next(iter(weights))
    for i, name in enumerate(uses.names):
        if name in reasons or i in biases:
            continue
        if i not in uses.parts:
            reasons[name] = ("only looked up (an embedding): the rows read stay fixed, the others get no "
                             "teleport gradient" if i in uses.frozen else "not used in the teleport forward pass")
            continue
        bias = next((b for b, w in biases.items() if w == i), None)
        if bias is not None and uses.names[bias] in reasons:
            reasons[name] = f"its bias {uses.names[bias]} cannot move"
            continue
        try:
            blocks.append(_block(uses, i, bias))
        except Unsupported as e:
            reasons[name] = str(e)
    movable = {id(p) for blk in blocks for p in blk.params}
    for b, w in biases.items():
        if id(uses.params[b]) not in movable:
            why = "cannot move" if uses.names[w] in reasons else "moves with another of its biases only"
            reasons.setdefault(uses.names[b], f"the bias of {uses.names[w]}, which {why}")
    return blocks, {n: reasons[n] for n in uses.names if n in reasons}


def _block(uses: Uses, i: int, bias: int | None) -> Block:
    p, parts = uses.params[i], uses.parts[i]
    layouts = {part.layout for part in parts}
    if len(layouts) > 1:
        raise Unsupported("used both as W and as Wᵀ (its null space is not a space of rows)")
    layout = layouts.pop()
    rows = p.shape[0] if layout == "natural" else p.shape[1]
    bias_rows = None if bias is None else _bias_rows(parts, rows, uses.params[bias], bias)
    frozen = _frozen_rows(uses.frozen.get(i, []), p, layout, rows)
    name = uses.names[i].removesuffix(".weight")
    return Block(name, p, None if bias is None else uses.params[bias], layout, bias_rows, parts, frozen, bias)


def _bias_rows(parts: list[Part], rows: int, bias: Tensor, b: int) -> Tensor | None:
    """Which bias element each layout row adds (one element per row, one row per element); None: row i adds
    element i (decided on the host when every use adds the whole bias to every row: no device reads)."""
    mine = [part for part in parts if part.bias == b]
    if all(part.rows is None and part.bias_index is None for part in mine) and bias.numel() == rows:
        return None
    device = bias.device
    out = torch.full((rows,), -1, dtype=torch.long, device=device)
    for part in parts:
        if part.bias != b:
            continue
        r = torch.arange(rows, device=device) if part.rows is None else part.rows
        elems = arange_index(bias, part.bias_index).reshape(-1)
        if elems.numel() != r.numel():
            raise Unsupported("its bias does not match its rows")
        if bool(((out[r] >= 0) & (out[r] != elems)).any()):
            raise Unsupported("rows added to different bias elements in different uses")
        out[r] = elems
    valid = out[out >= 0]
    if valid.numel() != torch.unique(valid).numel():
        raise Unsupported("one bias element added to several rows")
    if bool((out == torch.arange(rows, device=device)).all()):
        return None
    return out


def _frozen_rows(looked_up: list[tuple[str, Tensor]], p: Tensor, layout: str, rows: int) -> Tensor | None:
    if not looked_up:
        return None
    mask = torch.zeros(rows, dtype=torch.bool, device=p.device)
    for how, idx in looked_up:
        if how == "rows" and layout == "natural":
            mask[idx] = True
            continue
        elems = torch.zeros(p.numel(), dtype=torch.bool, device=p.device)
        if how == "rows":
            elems.view(p.shape[0], -1)[idx] = True
        else:
            elems[idx] = True
        mask |= elems.view(rows, -1).any(1) if layout == "natural" else elems.view(p.shape).any(0)
    return mask


def partition(block: Block) -> list[RowClass]:
    """Group the block's rows by the set of uses reading them; fixed and unread rows form no class."""
    parts = block.parts
    if all(p.rows is None for p in parts):
        if block.frozen is None:
            return [RowClass(None, parts)]
        if not bool(block.frozen.all()):  # every use reads every row, a lookup fixes some: one masked class
            return [RowClass(None, parts, mask=~block.frozen)]
    member = torch.zeros(len(parts) + 1, block.rows, dtype=torch.uint8, device=block.weight.device)
    for k, p in enumerate(parts):
        member[k, slice(None) if p.rows is None else p.rows] = 1
    if block.frozen is not None:
        member[-1] = block.frozen.to(torch.uint8)
    signatures, inverse = torch.unique(member.T, dim=0, return_inverse=True)  # (classes, P+1), (rows,)
    classes = []
    for c, sig in enumerate(signatures.tolist()):
        if sig[-1] or not any(sig[:-1]):
            continue  # looked up by an embedding, or read by no linear map: stays
        rows = (inverse == c).nonzero().squeeze(1)
        whole = rows.numel() == block.rows
        classes.append(RowClass(None if whole else rows, [p for k, p in enumerate(parts) if sig[k]]))
    return classes


def fixed_widths(blocks: list[Block]) -> None:
    """Every kept basis of the ``cols`` route (R with fewer columns N than inputs) padded with zero columns to N, so
    that the tensors a captured tick reads keep their shapes when a batch's rank differs (``teleport.ascent.graphs``):
    on an LM's teleport batch two equal input columns (the same token at the same position of two sequences, at
    block 0; the same first token, at every block) make the rank N − 1, N − 2, ... from batch to batch, and each
    rank captured anew. A zero column projects nothing (π(G) = G − (G K) Kᵀ), but moves the rounding: every way of
    ascending pads alike, so that they take the same steps to the bit (the difference H·∇L divides that rounding by
    ε ~ 1e-8). The rank a class reports is its own; a basis that classes share stays shared."""
    padded: dict[int, Basis] = {}
    for b in blocks:
        for cls in b.classes:
            basis = cls.basis
            if basis is None or basis.route != "cols" or basis.kept is None or basis.kept.shape[1] >= cls.columns:
                continue
            if id(basis) not in padded:
                padded[id(basis)] = replace(basis, kept=F.pad(basis.kept, (0, cls.columns - basis.kept.shape[1])))
            cls.basis = padded[id(basis)]
