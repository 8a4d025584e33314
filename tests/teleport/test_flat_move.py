"""The device ascent's move on flat runs (``teleport.ascent.flat_move``) is the per-weight ``where`` move, bit for
bit."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from teleport.ascent import flat_move
from teleport.ascent.flat_move import FlatMove


def _per_weight(w: list[Tensor], origin: list[Tensor], u: list[Tensor], start: Tensor, retry: Tensor,
                exhausted: Tensor, eta: Tensor, u_new: list[Tensor]) -> None:
    """The move as the device ticks wrote it before: five kernels a weight."""
    for wi, o, d, dn in zip(w, origin, u, u_new, strict=True):
        torch.where(start, wi, o, out=o)
        if dn is not d:
            torch.where(start, dn, d, out=d)
        torch.where(exhausted, o, wi, out=wi)
        torch.where(start | retry, torch.addcmul(o, d, eta.to(d.dtype)), wi, out=wi)


def _weights(dtypes: tuple[torch.dtype, ...]) -> list[nn.Parameter]:
    shapes = [(5, 4), (5,), (3, 2, 2), (7,), (1,)]
    return [nn.Parameter(torch.randn(s, dtype=dtypes[i % len(dtypes)])) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("chunk", [flat_move.CHUNK, 12])  # one run per dtype; runs cut at 12 elements
def test_every_branch_moves_as_the_per_weight_where(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(flat_move, "CHUNK", chunk)
    torch.manual_seed(0)
    w = _weights((torch.float32, torch.float64))
    mine = [p.detach().clone() for p in w]
    flat = FlatMove(list(w))
    if chunk == 12:
        assert len(flat.runs) > 2  # the cut happened, within each dtype
    ref_origin = [torch.zeros_like(p) for p in mine]
    ref_u = [torch.zeros_like(p) for p in mine]
    t, f = torch.tensor(True), torch.tensor(False)
    branches = [(t, f, f), (f, t, f), (f, f, t), (f, f, f), (t, f, f), (f, t, f)]  # start, retry, exhausted
    with torch.no_grad():
        for k, (start, retry, exhausted) in enumerate(branches):
            u_new = [torch.randn_like(p) for p in mine]
            if k == 4:
                u_new[0][0] = float("nan")  # a non-finite direction: where keeps it out of what it does not choose
            eta = torch.tensor(0.5 / (k + 1), dtype=torch.float64)
            _per_weight(mine, ref_origin, ref_u, start, retry, exhausted, eta, u_new)
            flat.move(start, retry, exhausted, eta, u_new)
            for got, ref in ((w, mine), (flat.origin, ref_origin), (flat.u, ref_u)):
                assert all(torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and
                           torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(got, ref, strict=True))
        flat.move(f, f, t, eta, flat.u)  # every try failed: W₀ exactly, though U holds a NaN
        _per_weight(mine, ref_origin, ref_u, f, f, t, eta, ref_u)
        assert all(torch.equal(a, b) for a, b in zip(w, mine, strict=True))
        assert all(torch.isfinite(p).all() for p in w)


def test_the_views_are_the_weights_shapes_in_flat_storage_and_the_parameters_keep_theirs() -> None:
    w = _weights((torch.float32,))
    ptrs = [p.data_ptr() for p in w]
    flat = FlatMove(list(w))
    assert [o.shape for o in flat.origin] == [p.shape for p in w] == [d.shape for d in flat.u]
    assert len({o.untyped_storage().data_ptr() for o in flat.origin}) == 1  # one run: one storage
    with torch.no_grad():
        flat.move(torch.tensor(True), torch.tensor(False), torch.tensor(False), torch.tensor(1.0),
                  [torch.ones_like(p) for p in w])
    assert [p.data_ptr() for p in w] == ptrs  # moved in place: a captured graph's addresses hold
