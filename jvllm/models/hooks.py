"""Forward hooks of the decoder-layer loop, shared by every model family.

A family's `__call__(..., hooks=None)` calls, at trace time:
    x = hooks.embedded(x)          after the embedding (first stage only)
    x = hooks.after_layer(i, x)    after decoder layer i of the stage (0-based within the stage)
    h = hooks.final(h)             after the final norm (last stage only)
With `hooks=None` nothing is added to the traced program, so the plain step programs are unchanged.
"""
from __future__ import annotations


class HiddenTap:
    """Records the residual stream in transformers' `output_hidden_states` numbering: entry 0 the
    embeddings, entry i the output of layer i-1, the last entry after the final norm (it replaces
    the raw output of the last layer). `values` has num_layers + 1 arrays [T, hidden]."""

    def __init__(self):
        self.values: list = []

    def embedded(self, x):
        self.values.append(x)
        return x

    def after_layer(self, i: int, x):
        self.values.append(x)
        return x

    def final(self, h):
        self.values[-1] = h
        return h
