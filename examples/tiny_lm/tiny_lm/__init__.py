"""A tiny GPT-style character language model, with its data and loss, as a Teleport Lab code package.

``tiny_lm.model:gpt`` builds the model, ``tiny_lm.data:python_source`` the data (the source text of a
standard-library module: no download) and ``tiny_lm.loss:next_token`` is the loss. See ../README.md.
"""
