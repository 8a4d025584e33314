"""One host read per ascent step of the host guard (what ``auto`` runs), counted at every place a value can leave
the device — not only where a teleporter's ``reads`` (``teleport.hvp.objective.HostReads``) counts its own: a tensor
turned into a Python number, bool or list (``item``, ``__bool__``, ``tolist``, ...), a boolean-mask index, and the ops
that read values below Python (``nonzero``, ``masked_select``, ``_local_scalar_dense``, ...). On a GPU each is a sync;
a step that adds one (a stray ``.item()``, an ``if`` on a tensor) fails here on the CPU, before a GPU ever runs it."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from teleport import Teleporter
from tests.teleport import families
from tests.teleport.test_on_device import HOST_OPS, _Ops

pytestmark = pytest.mark.usefixtures("float64")

T = torch.Tensor
TO_HOST = {T.item, T.__bool__, T.tolist, T.__float__, T.__int__, T.__index__, T.numpy, T.cpu, T.any, T.all,
           T.nonzero, torch.nonzero, torch.masked_select, T.masked_select, torch.unique, torch.equal, T.equal}
READING_OPS = set(HOST_OPS) - {"lift_fresh"}  # what a CUDA graph cannot hold, less a host value sent to the device


class _Python(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in TO_HOST or (func in (T.__getitem__, T.__setitem__) and _masks(args[1])):
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _masks(index: Any) -> bool:
    """A boolean-mask index (``t[t > 0]``): its result's shape is read from the values (a nonzero inside the kernel,
    below the dispatcher's Python key, where no dispatch mode sees it)."""
    parts = index if isinstance(index, tuple | list) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)


def _reads(case: families.Case, steps: int) -> tuple[int, int, int, list[str]]:
    """(the reads one teleport of ``steps`` makes, its tries (steps + back-offs), its teleporter's count, the reads)."""
    config = replace(families.OPEN, steps=steps, ascent="host", check_first=False)
    teleporter = Teleporter(copy.deepcopy(case.model), case.loss_fn, config)
    with _Python() as python, _Ops() as dispatched:
        report = teleporter.teleport(case.x, case.y)
    assert report.steps == steps, report.stop_reason
    reads = python.reads + [op for op in dispatched.seen if op.split(".")[0] in READING_OPS]
    return len(reads), steps + report.backoffs, teleporter.reads.count, reads


@pytest.mark.parametrize("name", ["linear", "tied_lm", "transformer-encoder-batch_first=True",
                                  "conv-conv2d_depthwise", "shared_and_loop"])
def test_the_host_guard_reads_the_device_once_a_try(name: str) -> None:
    case = families.CASES[name]()
    (reads_1, tries_1, counted_1, seen_1), (reads_3, tries_3, counted_3, seen_3) = _reads(case, 1), _reads(case, 3)
    assert reads_3 - reads_1 == tries_3 - tries_1 == counted_3 - counted_1, \
        f"reads added by 2 more steps: {sorted(set(seen_3) - set(seen_1)) or seen_3}"
