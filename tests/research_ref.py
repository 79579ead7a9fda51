"""The trainer's view of a Llama-family model: a plain dense JAX forward over the flat params
{jvllm name: array} (what a Flax/Optax training step differentiates), written independently of the
engine's paged path. Default rotary embeddings, no biases, no q/k norms, no sliding window."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _rms(x, w, eps):
    return w * (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps))


def _rope(x, theta):  # x [T, H, d], rotate-half
    T, _, d = x.shape
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    f = jnp.asarray(np.arange(T)[:, None] * inv[None, :], jnp.float32)
    cos, sin = jnp.cos(f)[:, None, :], jnp.sin(f)[:, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def logprobs(params: dict, cfg, ids) -> jax.Array:
    """log_softmax of the logits [T, vocab] of the token sequence `ids` (float32)."""
    ids = jnp.asarray(ids, jnp.int32)
    T = ids.shape[0]
    x = params["embed"][ids]
    mask = jnp.tril(jnp.ones((T, T), bool))
    rep = cfg.num_heads // cfg.num_kv_heads
    for i in range(cfg.num_layers):
        p = lambda n: params[f"layers.{i}.{n}"]  # noqa: E731
        h = _rms(x, p("input_layernorm.weight"), cfg.rms_norm_eps)
        q = _rope(jnp.einsum("td,dhk->thk", h, p("self_attn.q_proj")), cfg.rope_theta)
        k = _rope(jnp.einsum("td,dhk->thk", h, p("self_attn.k_proj")), cfg.rope_theta)
        v = jnp.einsum("td,dhk->thk", h, p("self_attn.v_proj"))
        k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
        s = jnp.einsum("qhd,khd->hqk", q, k) * cfg.head_dim ** -0.5
        a = jax.nn.softmax(jnp.where(mask[None], s, -jnp.inf), -1)
        x = x + jnp.einsum("thk,hkd->td", jnp.einsum("hqk,khd->qhd", a, v), p("self_attn.o_proj"))
        h = _rms(x, p("post_attention_layernorm.weight"), cfg.rms_norm_eps)
        x = x + (jax.nn.silu(h @ p("mlp.gate_proj")) * (h @ p("mlp.up_proj"))) @ p("mlp.down_proj")
    x = _rms(x, params["norm.weight"], cfg.rms_norm_eps)
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jax.nn.log_softmax(x @ w, -1)


def sequence_logprobs(params: dict, cfg, prompt, cont) -> np.ndarray:
    """log p(cont[i] | prompt + cont[:i]) for each i, float32."""
    ids = list(prompt) + list(cont)
    lp = np.asarray(logprobs(params, cfg, ids))
    return np.array([lp[j - 1, ids[j]] for j in range(len(prompt), len(ids))], np.float32)
