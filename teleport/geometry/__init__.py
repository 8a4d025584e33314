"""Steps 1 and 2 of Algorithm 1: what each weight's inputs are, and the null space a step may move in.

- ``uses``: the linear maps a parameter takes part in (linear, matmul, addmm, conv), each as input columns X;
- ``capture``: every use of every parameter in the forward pass (the representation matrices R of eqs. 9-11, per
  parameter, not per layer: tied, shared and packed weights included);
- ``blocks``: rows of a weight that share their uses (row classes), and π on them;
- ``bases``: SVD with the τ rule (eq. 3), by the cheapest exact route; ``certificate`` proves a full rank without
  eigenvalues; ``eigh_route`` measures where the eigh runs fastest;
- ``projection``: π(G) = G − (G B) Bᵀ (eqs. 12-17);
- ``layer_bases``: every class' basis for a batch, in one process or across data-parallel ranks.
"""
