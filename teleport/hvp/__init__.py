"""The teleport objective ½‖∇L‖² and its gradient H·∇L, and the ascent's direction U = π(H·∇L).

- ``objective``: L, ‖∇L‖² and ∇L with its graph; H·∇L by one double backward, summed across ranks;
- ``spanfree``: at exact τ = 1, H·∇L without the part π removes anyway (a Linear's weight through its outputs);
- ``factored``: π(H·∇L) of a Linear from its factors, no (out, in) H·∇L formed;
- ``difference``: H·∇L from a difference of two gradients, no double backward;
- ``direction``: U = π(H·∇L) with the H·∇L the config asks for.
"""
