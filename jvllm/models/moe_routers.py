"""The mixture-of-experts routers: router logits [T, E] (float32) -> (top_idx [T, k] int32,
top_w [T, k] float32), one function per `MoEConfig.scoring`, picked once per layer (`router_for`).

  softmax   Mixtral / Qwen-MoE / OLMoE: softmax over all experts, the k largest, renormalised to
            sum to one when `norm_topk_prob`; with a selection bias (ERNIE 4.5) the k largest of
            probability + bias, weighted by their probabilities
  sigmoid   DeepSeek-V3 / GLM-4.5 ("noaux_tc"): sigmoid scores; the choice ranks score + a learned
            per-expert bias (which balances the load; it never weights an output) among the experts
            of the `topk_groups` best of `num_groups` groups (a group's worth is the sum of its two
            best biased scores); the chosen experts are weighted by their unbiased scores,
            renormalised when `norm_topk_prob` (with transformers' 1e-20 in the sum), times
            `routed_scaling`

Ties between equal scores go to the lower expert index (`jax.lax.top_k`); torch's topk may order
exact ties differently, which random float weights never produce.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jvllm.config import MoEConfig


def softmax_topk(logits, bias, *, k: int, norm: bool):
    probs = jax.nn.softmax(logits, axis=-1)
    if bias is None:
        top_w, top_idx = jax.lax.top_k(probs, k)
    else:  # ERNIE 4.5: chosen by probability + bias, weighted by the probability
        _, top_idx = jax.lax.top_k(probs + bias.astype(jnp.float32)[None, :], k)
        top_w = jnp.take_along_axis(probs, top_idx, axis=-1)
    if norm:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
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


def router_for(m: MoEConfig):
    """`f(logits [T, E] float32, bias [E] or None) -> (top_idx, top_w)` for `m`'s scoring."""
    if m.scoring == "softmax":
        return functools.partial(softmax_topk, k=m.top_k, norm=m.norm_topk_prob)
    return functools.partial(sigmoid_grouped_topk, k=m.top_k, norm=m.norm_topk_prob, groups=m.num_groups,
                             topk_groups=m.topk_groups, scaling=m.routed_scaling)
