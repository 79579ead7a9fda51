"""Known-acceptance workloads for speculative decoding on random weights (issue 24), used by
`spec_b1.py`.

Random weights make acceptance arbitrary, and their greedy continuations never repeat an n-gram;
with near-uniform attention the continuation depends on the whole context, so no prompt can hold
"what comes next". The weights are therefore changed after construction, through the engine's own
`LLM.get_weights()` / `LLM.update_weights()`, so that the next token is a function of the current
token only. Shapes, dtypes, the programs and the bytes each step reads are unchanged (XLA cannot
know that weights are zero), so the step costs what it costs with the random weights:

  oproj   every layer's attention output projection (o_proj) zeroed: the residual stream is
          embed(t) plus the MLPs of it, greedy decoding is t -> f(t) with f fixed by the random
          MLPs and head. Hazard: f's top-2 logit gaps are those of random logits, so two programs
          (a decode step, a k+1-token verify step) may round a near tie differently and the
          continuation then leaves the known orbit (`min_top2_gap` in the JSON says how close).
  robust  as oproj, and every down_proj zeroed (the residual is embed(t) alone) and the LM head
          set to a scaled copy of the embedding with its vocabulary permuted: f is a random
          permutation with a top-2 logit gap of tens of nats (no program can round it away).
          Untied heads only (a tied head is the embedding itself: f would be the identity).

The B1 prompt is a random seed prompt P, then its own greedy continuation C (generated once by the
plain engine with the same weights), then P's last token again: the target's output after it is
exactly C (`plain_matches_expected` checks it) and the n-gram proposer finds C in the prompt.
`corrupt_every` J replaces every J-th token of the copy of C by another token, which lowers the
n-gram acceptance in a controlled way (`ngram_acceptance` replays the proposer on the host).
"""
from __future__ import annotations

import dataclasses
import weakref

import numpy as np

WORKLOADS = ("oproj", "robust")
HEAD_LOGIT = 30.0  # robust: the winning logit (others ~ N(0, (HEAD_LOGIT / sqrt(hidden))^2))


def transform(live: dict, workload: str, tied: bool, seed: int = 0) -> dict:
    """{name: new array} for a workload, from {name: live device array} (`live_params` names)."""
    import jax.numpy as jnp

    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r}: use one of {list(WORKLOADS)}")
    o = {n: jnp.zeros_like(a) for n, a in live.items() if n.endswith("self_attn.o_proj")}
    if not o:
        raise ValueError(f"workload {workload!r}: the model has no '*.self_attn.o_proj' weights "
                         f"(names: {sorted(live)[:6]}...)")
    if workload == "oproj":
        return o
    if tied or "lm_head" not in live:
        raise ValueError("workload 'robust' needs an untied LM head (a tied head is the embedding: f(t) = t)")
    down = {n: jnp.zeros_like(a) for n, a in live.items() if n.endswith("mlp.down_proj")}
    if not down:
        raise ValueError("workload 'robust': the model has no '*.mlp.down_proj' weights")
    emb, head = live["embed"], live["lm_head"]
    V, d = emb.shape
    if head.shape != (d, V):
        raise ValueError(f"workload 'robust': lm_head shape {head.shape}, expected (hidden, vocab) = {(d, V)}")
    perm = np.random.default_rng(seed).permutation(V)  # f(t) = perm[t]
    inv = np.argsort(perm)                             # column v of the head is the embedding of perm^-1(v)
    e = emb.astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(jnp.square(e)))
    new_head = (e[jnp.asarray(inv)] * (HEAD_LOGIT / (d * rms))).T.astype(head.dtype)
    return {**o, **down, "lm_head": new_head}


_ORIGINAL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # runner -> its construction-time arrays


def _for_runner(runner, workload: str, seed: int) -> dict:
    """The workload's arrays for `runner`, computed from (and restoring) the arrays it was built
    with: workloads can follow each other on one engine. The originals stay referenced (device
    memory: the replaced o_proj, down_proj and head arrays), no copies."""
    from jvllm.worker.weights import live_params

    orig = _ORIGINAL.get(runner)
    if orig is None:
        orig = _ORIGINAL[runner] = dict(live_params(runner))
    new = transform(orig, workload, runner.cfg.tie_word_embeddings, seed)
    touched = [n for n in orig if n.endswith(("self_attn.o_proj", "mlp.down_proj")) or n == "lm_head"]
    return {n: new.get(n, orig[n]) for n in touched}


def apply(llm, workload: str, seed: int = 0) -> None:
    """Give `llm`'s target (through `LLM.update_weights`) and its draft model, if any (the draft
    runner's weights, the same transform), the workload's weights."""
    from jvllm.worker.weights import nest, update_params

    eng = llm.llm_engine
    llm.update_weights(nest(_for_runner(eng.runner, workload, seed)))
    prop = getattr(eng.speculator, "proposer", None)
    runner = getattr(prop, "runner", None)
    if runner is not None:  # a draft model: the draft = target bound needs the same weights
        update_params(runner, _for_runner(runner, workload, seed))


def ngram_acceptance(tokens: list[int], start: int, k: int, lo: int, hi: int) -> tuple[float, int]:
    """(acceptance, steps) the n-gram proposer would reach decoding tokens[start:] after
    tokens[:start], greedy: the first token comes from the prefill (no drafts), then each step
    emits its accepted drafts + 1 (the budget capped so the request ends at len(tokens))."""
    from jvllm.spec_decode.ngram import NgramProposer

    prop = NgramProposer(k, lo, hi)
    t, drafted, accepted, steps = start + 1, 0, 0, 1
    while t < len(tokens):
        d = prop.propose(tokens[:t], min(k, len(tokens) - t - 1))
        a = 0
        while a < len(d) and tokens[t + a] == d[a]:
            a += 1
        drafted += len(d)
        accepted += a
        t += a + 1
        steps += 1
    return (accepted / drafted if drafted else 0.0), steps


@dataclasses.dataclass
class Case:
    """One request of the workload: its prompt and the output the target must produce."""
    seed_prompt: list[int]
    continuation: list[int]          # C: the plain engine's greedy continuation of the seed prompt
    corrupt_every: int | None        # J: every J-th token of the copy replaced (None: exact copy)
    prompt: list[int]
    expected: list[int]              # the first output_len tokens of C

    def simulate(self, k: int, lo: int, hi: int) -> tuple[float, int]:
        return ngram_acceptance(self.prompt + self.expected, len(self.prompt), k, lo, hi)


def make_case(seed_prompt: list[int], continuation: list[int], output_len: int, corrupt_every: int | None,
              vocab: int) -> Case:
    """P + copy(C) + [P[-1]], the copy with every J-th token (positions J-1, 2J-1, ...) replaced by
    a token that is not the original (deterministic)."""
    if len(continuation) < output_len:
        raise ValueError(f"continuation of {len(continuation)} tokens, output_len {output_len} needs at least that")
    if corrupt_every is not None and corrupt_every < 2:
        raise ValueError(f"corrupt_every must be >= 2 (or None), got {corrupt_every}")
    copy = list(continuation)
    if corrupt_every is not None:
        for i in range(corrupt_every - 1, len(copy), corrupt_every):
            copy[i] = (copy[i] + 1 + (i % 7)) % vocab
    return Case(list(seed_prompt), list(continuation), corrupt_every, list(seed_prompt) + copy + [seed_prompt[-1]],
                list(continuation[:output_len]))


def pick_corruption(seed_prompt, continuation, output_len, vocab, k, lo, hi, target: float,
                    candidates=range(2, 65)) -> tuple[int | None, float]:
    """The J whose simulated acceptance is the smallest one >= `target` (None, the exact copy, if
    no J reaches it), and that acceptance."""
    best = (None, make_case(seed_prompt, continuation, output_len, None, vocab).simulate(k, lo, hi)[0])
    for j in candidates:
        acc = make_case(seed_prompt, continuation, output_len, j, vocab).simulate(k, lo, hi)[0]
        if target <= acc < best[1]:
            best = (j, acc)
    return best
