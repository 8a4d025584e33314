"""The ascent's direction U = π(H·∇L) for every moving weight, with the H·∇L the config asks for.

``exact`` (the paper's gradient): the second backward of ∇L's graph (``teleport.hvp.objective``); at exact τ = 1 a
weight used by F.linear alone gets π(H·∇L) from its factors (``teleport.hvp.factored``), the part π removes never
formed (``teleport.hvp.spanfree``). ``difference``: H·∇L from a difference of two gradients
(``teleport.hvp.difference``), then projected as the exact one is.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import Tensor

from teleport.config import TeleportConfig
from teleport.distributed import Collective
from teleport.geometry.blocks import Block
from teleport.hvp.difference import Shifted, ShiftScale, difference_hvp
from teleport.hvp.factored import factored_direction
from teleport.hvp.objective import Objective, teleport_gradient, teleport_gradient_and

Direction = Callable[[Objective], list[Tensor]]  # π(H·∇L) of the moving weights at an objective


def exact_tau(config: TeleportConfig) -> bool:
    """τ = 1 read as the numerical rank: π removes all of the inputs' span (``teleport.hvp.spanfree`` applies)."""
    return config.tau >= 1.0 and config.tau_rule == "numerical_rank"


def project_blocks(blocks: list[Block], grads: list[Tensor], inplace: bool = False) -> list[Tensor]:
    """π of each block's gradients; ``grads`` lists every block's params in order (overwritten if ``inplace``)."""
    out: list[Tensor] = []
    i = 0
    for b in blocks:
        out += b.projected(grads[i : i + len(b.params)], inplace)
        i += len(b.params)
    return out


def difference_direction(obj: Objective, blocks: list[Block], weights: list[Tensor], params: list[Tensor],
                         shifted: Shifted, scale: ShiftScale | None = None) -> list[Tensor]:
    """π(H·∇L) with H·∇L from a difference of gradients (``scale``: its shift's learned factor)."""
    return project_blocks(blocks, difference_hvp(obj, params, weights, shifted, scale), inplace=True)


def ascent_direction(obj: Objective, blocks: list[Block], weights: list[Tensor], params: list[Tensor],
                     comm: Collective | None, config: TeleportConfig) -> list[Tensor]:
    """π(H·∇L) for every moving weight, block by block, from the objective's graph."""
    if not exact_tau(config):
        return project_blocks(blocks, teleport_gradient(obj, weights, params, comm), inplace=True)
    return factored_direction(obj, blocks, comm, teleport_gradient_and, project_blocks)


def direction(blocks: list[Block], weights: list[Tensor], params: list[Tensor], config: TeleportConfig,
              comm: Collective | None, shifted: Shifted | None, scale: ShiftScale | None) -> Direction:
    """π(H·∇L) as the config asks: by a difference where ``shifted`` is given, else exact."""
    if shifted is not None:
        return partial(difference_direction, blocks=blocks, weights=weights, params=params, shifted=shifted,
                       scale=scale)
    return partial(ascent_direction, blocks=blocks, weights=weights, params=params, comm=comm, config=config)
