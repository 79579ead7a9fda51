"""Batch-invariant mode (`LLM(batch_invariant=True)`, `--batch-invariant`): a request's sampled
tokens and logprobs are bit-identical whatever else is in its batch, however its prompt was chunked
and whether its prefix came from the prefix cache. The idea is Thinking Machines' ("Defeating
Nondeterminism in LLM Inference") and vLLM's `VLLM_BATCH_INVARIANT`: a token's result must not
depend on the shape of the batch it was computed in, only on its own inputs. vLLM swaps in kernels
whose per-row result is the same for any M (fixed-tile persistent matmuls, fixed-split attention,
row-wise norms); jvllm, which hands its kernels to XLA, instead gives every step the same shapes.

What breaks invariance in the default mode, and what this mode does about it (chosen once, at
construction; nothing is decided per step):

- The token bucket. A step is padded to the smallest bucket that holds it, so the same row goes
  through matmuls of different M. Libraries pick a GEMM algorithm by shape (tiling, split-K over
  the reduction for small M on GPUs), and a different algorithm sums in a different order.
  -> ONE token bucket, `max_num_batched_tokens`: every step runs the same step program, so every
  row of every step meets the same kernels with the same shapes.
- The decode-only variant. A step whose requests all decode runs a program with one-query
  attention tiles (and, on GPUs, split-K over the KV chunks, whose split count depends on the
  batch size); a step with a prefill chunk in it runs the mixed program. A request's decode
  step would change program with its neighbours.
  -> no decode-only variant: every step uses the mixed (query-tile) program. Its tiles are never
  split-K: each tile walks its request's keys in chunks of `kv_chunk_blocks` blocks aligned at
  position 0, so how a prompt is chunked, or whether its prefix is cached, does not move a chunk
  boundary. Chunks past a row's last key are masked, and a masked chunk leaves the online-softmax
  state bit for bit unchanged (p = 0, correction 1), so the batch's longest context (the loop's
  trip count) does not matter either.
- The sampler program. An all-greedy batch without logprobs uses the argmax-only program; any
  other batch the full sampler. -> the full sampler for every batch. Sampling noise is already
  per row (the key of the request's seed folded with its output index), and every other sampler
  op works row by row.

What holds, and where:

- On CPU: tokens and logprobs bit-identical across batch composition, prompt chunking (within the
  one engine's bucket) and prefix-cache hits (tests/test_batch_invariant.py).
- On GPU: the same program runs every step, so the mode removes every shape-dependent choice
  jvllm makes. It relies on XLA compiling each op of that program to one deterministic kernel
  that treats rows alike; run with `XLA_FLAGS=--xla_gpu_exclude_nondeterministic_ops=true`
  (set before jax starts) so no kernel uses atomics. Not measured bit for bit on a GPU yet.
- Not covered, anywhere: engines with different `max_num_batched_tokens`, dtypes, devices or
  tensor-parallel sizes (other programs); batches that also hold a request with structured
  outputs, user logits processors, penalties / logit bias / allowed or bad words (sampler
  variants with extra inputs), `return_hidden_states` or `steering` (the research step
  program): those batches run other programs that compute the same math but may fuse it
  differently. Equal on CPU in the tests, not promised.

Cost: small steps pay for the whole bucket (a B1 decode step computes `max_num_batched_tokens`
rows), so a smaller `max_num_batched_tokens` trades prefill throughput for decode latency.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StepVariants:
    """Which program variants the model runner may choose between per step.

    decode_variants: decode-only steps get their own one-query-tile program (False: every step
        runs the mixed program of its bucket).
    greedy_program: all-greedy batches without logprobs use the argmax-only sampler (False: the
        full sampler serves every batch)."""

    decode_variants: bool = True
    greedy_program: bool = True

    @classmethod
    def for_mode(cls, batch_invariant: bool) -> "StepVariants":
        return cls(decode_variants=False, greedy_program=False) if batch_invariant else cls()


def check_buckets(batch_invariant: bool, requested: tuple[int, ...] | None) -> None:
    """Raises ValueError when batch-invariant mode is given several token buckets (it runs one).
    `requested`: the user's `token_buckets` (None when not given)."""
    if batch_invariant and requested is not None and len(set(requested)) > 1:
        raise ValueError(f"batch_invariant=True runs one token bucket (max_num_batched_tokens); got token_buckets="
                         f"{tuple(sorted(set(requested)))}: give one bucket or none")


def step_buckets(batch_invariant: bool, requested: tuple[int, ...] | None, buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The token buckets the runner compiles: `buckets` (its largest the step budget
    `max_num_batched_tokens`) unchanged by default; in batch-invariant mode only the largest.
    Raises as `check_buckets`."""
    check_buckets(batch_invariant, requested)
    return (max(buckets),) if batch_invariant else tuple(buckets)
