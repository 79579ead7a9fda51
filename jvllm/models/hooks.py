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


class Steer:
    """Adds per-row steering vectors to the residual stream, in the `HiddenTap` numbering: entry i
    (0 = the embeddings, i = the output of layer i-1, i < num_layers) of token t gets
    `vecs[row[t], i]`; tokens with row -1 get nothing. vecs [R, num_layers, hidden], row [T] int32."""

    def __init__(self, vecs, row):
        import jax.numpy as jnp

        self.vecs, self.row, self.n = vecs, row, vecs.shape[1]
        self._jnp = jnp

    def _add(self, i: int, x):
        if i >= self.n:
            return x
        jnp = self._jnp
        v = self.vecs[jnp.maximum(self.row, 0), i]
        return x + jnp.where((self.row >= 0)[:, None], v, 0).astype(x.dtype)

    def embedded(self, x):
        return self._add(0, x)

    def after_layer(self, i: int, x):
        return self._add(i + 1, x)

    def final(self, h):
        return h


class Chain:
    """Hooks applied in order (steer first, then record what the next layer sees)."""

    def __init__(self, *hooks):
        self.hooks = [h for h in hooks if h is not None]

    def embedded(self, x):
        for h in self.hooks:
            x = h.embedded(x)
        return x

    def after_layer(self, i: int, x):
        for h in self.hooks:
            x = h.after_layer(i, x)
        return x

    def final(self, x):
        for h in self.hooks:
            x = h.final(x)
        return x
