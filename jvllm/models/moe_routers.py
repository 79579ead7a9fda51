"""The mixture-of-experts routers: router logits [T, E] (float32) -> (top_idx [T, k] int32,
top_w [T, k] float32), one function per `MoEConfig.scoring`, picked once per layer (`router_for`).

  softmax   Mixtral / Qwen-MoE / OLMoE: softmax over all experts, the k largest, renormalised to
            sum to one when `norm_topk_prob` (divided by max(their sum, `norm_min`)); with a
            selection bias (ERNIE 4.5) the k largest of probability + bias, weighted by their
            probabilities
  sigmoid   DeepSeek-V3 / GLM-4.5 ("noaux_tc"): sigmoid scores; the choice ranks score + a learned
            per-expert bias (which balances the load; it never weights an output) among the experts
            of the `topk_groups` best of `num_groups` groups (a group's worth is the sum of its two
            best biased scores); the chosen experts are weighted by their unbiased scores,
            renormalised when `norm_topk_prob` (with transformers' 1e-20 in the sum), times
            `routed_scaling`
  sparsemixer  Phi-3.5-MoE (inference form, top-2 only): the best expert, weighted by its softmax
            among the logits within a relative distance 2 * jitter_eps of the best (the others
            masked); then the best of the rest, weighted the same way among the rest

Ties between equal scores go to the lower expert index (`jax.lax.top_k`); torch's topk may order
exact ties differently, which random float weights never produce.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jvllm.config import MoEConfig


def softmax_topk(logits, bias, *, k: int, norm: bool, norm_min: float = 0.0):
    probs = jax.nn.softmax(logits, axis=-1)
    if bias is None:
        top_w, top_idx = jax.lax.top_k(probs, k)
    else:  # ERNIE 4.5: chosen by probability + bias, weighted by the probability
        _, top_idx = jax.lax.top_k(probs + bias.astype(jnp.float32)[None, :], k)
        top_w = jnp.take_along_axis(probs, top_idx, axis=-1)
    if norm:
        top_w = top_w / jnp.maximum(jnp.sum(top_w, axis=-1, keepdims=True), norm_min)
    return top_idx, top_w


def sigmoid_grouped_topk(logits, bias, *, k: int, norm: bool, groups: int, topk_groups: int, scaling: float):
    T, E = logits.shape
    scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)[None, :]
    if groups > 1 and topk_groups < groups:
        per_group = choice.reshape(T, groups, E // groups)
        worth = jnp.sum(jax.lax.top_k(per_group, 2)[0], axis=-1)            # [T, groups]
        _, keep = jax.lax.top_k(worth, topk_groups)                         # [T, topk_groups]
        kept = jnp.zeros((T, groups), bool).at[jnp.arange(T)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(kept, E // groups, axis=1), choice, -jnp.inf)
    _, top_idx = jax.lax.top_k(choice, k)
    top_w = jnp.take_along_axis(scores, top_idx, axis=-1)
    if norm:
        top_w = top_w / (jnp.sum(top_w, axis=-1, keepdims=True) + 1e-20)
    return top_idx, top_w * scaling


def _sparsemixer_pick(scores, masked, eps: float):
    """(index [T, 1], weight [T, 1]) of the best of `masked` (scores with earlier picks at -inf),
    weighted by its softmax over the entries of `masked` within 2 * eps of it relative to
    max(|score|, best) (transformers' sparsemixer, eval mode)."""
    best = jnp.max(masked, axis=-1, keepdims=True)
    idx = jnp.argmax(masked, axis=-1)[:, None]
    far = (best - scores) / jnp.maximum(jnp.abs(scores), best) > 2 * eps
    gates = jax.nn.softmax(jnp.where(far, -jnp.inf, masked), axis=-1)
    return idx, jnp.take_along_axis(gates, idx, axis=-1)


def sparsemixer_top2(logits, bias, *, eps: float):
    i1, w1 = _sparsemixer_pick(logits, logits, eps)
    rest = jnp.where(jnp.arange(logits.shape[1])[None, :] == i1, -jnp.inf, logits)
    i2, w2 = _sparsemixer_pick(logits, rest, eps)
    return jnp.concatenate([i1, i2], axis=1).astype(jnp.int32), jnp.concatenate([w1, w2], axis=1)


def router_for(m: MoEConfig):
    """`f(logits [T, E] float32, bias [E] or None) -> (top_idx, top_w)` for `m`'s scoring."""
    if m.scoring == "softmax":
        return functools.partial(softmax_topk, k=m.top_k, norm=m.norm_topk_prob, norm_min=m.norm_min)
    if m.scoring == "sparsemixer":
        return functools.partial(sparsemixer_top2, eps=m.jitter_eps)
    return functools.partial(sigmoid_grouped_topk, k=m.top_k, norm=m.norm_topk_prob, groups=m.num_groups,
                             topk_groups=m.topk_groups, scaling=m.routed_scaling)
