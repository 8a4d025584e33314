"""Step 3 of Algorithm 1: projected gradient ascent on ½‖∇L‖² with CAP and the guard, one batch at a time.

Read ``rules`` (when a try is accepted, how it is shortened or aimed), then ``run`` (a batch's state and the
``Ascent`` interface), then one implementation:

- ``host``: the host guard — Python decides after every try (the CPU's and data-parallel ranks' way);
- ``device`` + ``flat_move``: the same rules as device ticks, no host branch between kernels;
- ``graphs``: those ticks captured in a CUDA graph and replayed for the model's later batches;

``choose`` picks one, in one place.
"""
