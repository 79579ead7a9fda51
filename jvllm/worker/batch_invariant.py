"""Batch-invariant mode (`LLM(batch_invariant=True)`, `--batch-invariant`): a request's sampled
tokens and logprobs are bit-identical whatever else is in its batch, however its prompt was chunked
and whether its prefix came from the prefix cache. The idea is Thinking Machines' ("Defeating
Nondeterminism in LLM Inference") and vLLM's `VLLM_BATCH_INVARIANT`: a token's result must not
depend on the shape of the batch it was computed in, only on its own inputs. As vLLM does, the mode
swaps in ops whose per-row result is the same for any number of rows, so every token bucket stays.

What breaks invariance in the default mode, and what this mode does about it (chosen once, at
construction; nothing is decided per step):

- The matmuls. A step is padded to the smallest token bucket that holds it, so the same row goes
  through matmuls of different M; XLA hands a dot to a library (cuBLAS, Eigen) that picks its
  algorithm, tiling and split-K from the shape, M included, and a different algorithm sums in a
  different order. -> every projection (q/k/v/o, the MLP) and the LM head go through
  `jvllm.ops.fixed_tile_matmul`, whose tiles and K split come from the weights' shapes only
  (`jvllm.models.layers.projection` and `LMHead`, chosen from `ModelConfig.batch_invariant`);
  q/k/v and gate/up each run as one launch (`Projection.many`). The embedding is a row gather.
- The decode-only variant. A step whose requests all decode runs a program with one-query
  attention tiles (on GPUs a launch of its own: wider key steps for big batches, split-K over
  the KV chunks for small ones, the split count chosen from the batch size); a step with a
  prefill chunk in it runs the mixed program. A request's decode step would change program with
  its neighbours. -> no decode-only variant: every step uses the mixed (query-tile) program,
  whose launch (`pallas_attention.launch_defaults` for tiles of several queries) is one
  configuration for every bucket and never split-K. Each tile walks its request's keys in chunks
  aligned at position 0 (`kv_chunk_blocks` blocks in the XLA reference, `pages_per_block` pages
  in the kernel), so how a prompt is chunked, or whether its prefix is cached, does not move a
  chunk boundary. Chunks past a row's last key are masked, and a masked chunk leaves the
  online-softmax state bit for bit unchanged (p = 0, correction 1), so the batch's longest
  context (the loop's trip count) does not matter either.
- The sampler program. The default picks the smallest sampler variant that covers a batch's
  rows (whether any row truncates, wants logprobs, ...). -> every batch that samples or wants
  logprobs takes the largest variant. An all-greedy batch without logprobs keeps the argmax-only
  program: a greedy row's token is the first index of its row's maximum in both programs (the
  full sampler's greedy rows keep only the maximum's keys and take their argmax), and a maximum
  does not depend on the reduction's order (hazard: a row whose maximum is zero held as both -0.0
  and +0.0, or NaN, may pick another index in the two programs). Sampling noise is already per row (the key of the
  request's seed folded with its output index), and every other sampler op works row by row.

What holds, and where:

- On CPU: tokens and logprobs bit-identical across batch composition, token buckets, prompt
  chunking and prefix-cache hits (tests/test_batch_invariant.py; the fixed-tile matmul runs in
  Pallas interpret mode there, slower than XLA's dot).
- On GPU: the matmuls and the attention launch are fixed as above (the matmul's rows bit-equal
  across row counts and launches: `benchmarks/probes/fixed_tile_probe.py`). The rest (RMSNorm's row
  reduction, the sampler's row reductions, elementwise ops) relies on XLA compiling a row
  reduction with a reduction order that depends on the row length only, and on no kernel using
  atomics: run with `XLA_FLAGS=--xla_gpu_exclude_nondeterministic_ops=true` (set before jax
  starts). The whole engine is not measured bit for bit on a GPU yet.
- Not implemented (a ValueError at start-up): quantized weights, mixture-of-experts models,
  speculative decoding.
- Not covered, anywhere: engines with different dtypes, devices, `kv_chunk_blocks` /
  `query_tile` or tensor-parallel sizes (other programs); batches that also hold a request with
  structured outputs, user logits processors, penalties / logit bias / allowed or bad words
  (sampler variants with extra inputs), `return_hidden_states` or `steering` (the research step
  program): those batches run other programs that compute the same math but may fuse it
  differently. Equal on CPU in the tests, not promised.

Cost: the fixed-tile matmul instead of the library's best GEMM for each shape (close to it at
decode, where both stream the weights; slower at prefill sizes), the mixed program (query tiles,
no split-K) for decode-only steps, and the largest sampler variant for batches that sample.
Figures: benchmarks/README.md.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StepVariants:
    """Which program variants the model runner may choose between per step.

    decode_variants: decode-only steps get their own one-query-tile program (False: every step
        runs the mixed program of its bucket).
    full_sampler: every batch that needs the sampler takes its largest variant (False: the
        smallest that covers the batch's rows). All-greedy batches without logprobs use the
        argmax-only program in both modes."""

    decode_variants: bool = True
    full_sampler: bool = False

    @classmethod
    def for_mode(cls, batch_invariant: bool) -> "StepVariants":
        return cls(decode_variants=False, full_sampler=True) if batch_invariant else cls()
