"""Teleportation with input null-space gradient projection (Wu, Dong, Aloui, Tarokh, ICML 2025).

Pure PyTorch. The paper's three steps live in one module each:

- ``capture`` / ``uses``: every use of every parameter in the forward pass and its input columns
  (the representation matrices R of eqs. 9-11, per parameter, not per layer);
- ``blocks``: rows of a weight that share their uses, and π on them;
- ``bases``: SVD with the τ rule (eq. 3) and the projection π (eqs. 12-17);
- ``nullspace``: projected gradient ascent on ½‖∇L‖² with CAP (eq. 5, Algorithm 1);
- ``objective``: ½‖∇L‖² and its gradient H·∇L (one double backward), summed across ranks;

plus ``symmetry``, the symmetry-teleport baseline of Zhao et al. for LeakyReLU MLPs.
"""

from teleport.bases import compute_basis
from teleport.capture import UseRecorder, capture_inputs
from teleport.executors import BasisExecutor, SerialExecutor, ThreadExecutor
from teleport.nullspace import teleport_batch
from teleport.objective import objective, teleport_gradient
from teleport.projection import Basis, project
from teleport.report import LayerReport, TeleportConfig, TeleportReport
from teleport.symmetry import symmetry_teleport_batch

__all__ = [
    "Basis",
    "BasisExecutor",
    "LayerReport",
    "SerialExecutor",
    "TeleportConfig",
    "TeleportReport",
    "ThreadExecutor",
    "UseRecorder",
    "capture_inputs",
    "compute_basis",
    "objective",
    "project",
    "symmetry_teleport_batch",
    "teleport_batch",
    "teleport_gradient",
]
