"""Teleportation with input null-space gradient projection (Wu, Dong, Aloui, Tarokh, ICML 2025), in pure PyTorch.

Start with ``reference`` (Algorithm 1 as plainly as it can be written), then ``teleporter`` (the same algorithm, fast,
with its state explicit); ``README.md`` has the map and the reading order.

>>> teleporter = Teleporter(model, F.cross_entropy, TeleportConfig(steps=8, cap=5.0))
>>> report = teleporter.teleport(x, y)  # the loss on (x, y) unchanged, ‖∇L‖² raised towards CAP
"""

from teleport.config import TeleportConfig
from teleport.executors import BasisExecutor, SerialExecutor, ThreadExecutor
from teleport.geometry.bases import compute_basis
from teleport.geometry.capture import UseRecorder, capture_inputs
from teleport.geometry.projection import Basis, project
from teleport.hvp.objective import objective, teleport_gradient
from teleport.reference import reference_teleport
from teleport.report import LayerReport, TeleportReport
from teleport.symmetry import symmetry_teleport_batch
from teleport.teleporter import Teleporter, teleport_batch

__all__ = (
    "Basis",
    "BasisExecutor",
    "LayerReport",
    "SerialExecutor",
    "TeleportConfig",
    "TeleportReport",
    "Teleporter",
    "ThreadExecutor",
    "UseRecorder",
    "capture_inputs",
    "compute_basis",
    "objective",
    "project",
    "reference_teleport",
    "symmetry_teleport_batch",
    "teleport_batch",
    "teleport_gradient",
)
