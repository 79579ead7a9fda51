"""Prefill chunks cut at token-bucket edges when that pads less (the scheduler's one use of the
runner's buckets).

A step runs the program of the smallest token bucket that holds its tokens, so a step of 40
decodes and a new 584-token prompt (624 tokens) runs the 1024-token program: 400 padded tokens
computed for nothing where prefill is compute-bound. Cutting the chunk at the 512 edge leaves 112
tokens for the next step (40 decodes + 112 = 152: the 256 program instead of the 64 one, which
costs the flat 128 below): 512 + 256 = 768 program tokens against 1024 + 128 = 1,152.

`BucketFit.chunk` makes that comparison for one prefill chunk: this step's program plus what the
tokens left over (the rest of the prompt, and the running requests' decodes) cost in the steps
after it. A program's cost is its tokens, but never below `flat_tokens`: under that a step reads
the weights in the time its matmuls would take anyway (FLAT_TOKENS's estimate for an 8B on an
H200: benchmarks/README.md, S1), and cutting there would only delay the prompt's first token. It
only ever shortens a chunk, so the budget, `max_num_seqs` and KV rules stay the scheduler's; a
chunk is cut to at least one token. Hazard: the cost is in program tokens, not measured time; the
engine option (`fit_chunks_to_buckets`) is off by default: a cut prompt gets its first token a
step later, and one GPU serving A/B did not settle the trade (benchmarks/README.md, S1).
"""
from __future__ import annotations

import bisect
import dataclasses

from jvllm.config import smallest_bucket


FLAT_TOKENS = 128  # the engine's `flat_tokens`: a decode step's time in prefill tokens, rounded to a bucket


@dataclasses.dataclass(frozen=True)
class BucketFit:
    buckets: tuple[int, ...]  # the runner's token buckets, ascending; the last is the step budget
    flat_tokens: int = 0      # a program of fewer tokens costs as much as one of this many

    def __post_init__(self):
        b = self.buckets
        if not b or any(x <= 0 for x in b) or list(b) != sorted(set(b)):
            raise ValueError(f"token buckets must be positive, distinct and ascending, got {b!r}")
        if self.flat_tokens < 0:
            raise ValueError(f"flat_tokens must be >= 0, got {self.flat_tokens}")

    def bucket(self, tokens: int) -> int:
        """The program tokens a step of `tokens` real tokens runs (0 for none)."""
        return smallest_bucket(self.buckets, tokens) if tokens > 0 else 0

    def step_cost(self, tokens: int) -> int:
        """One step of `tokens` real tokens: its program's tokens, at least `flat_tokens` (0: none)."""
        return max(self.bucket(tokens), self.flat_tokens) if tokens > 0 else 0

    def cost(self, tokens: int) -> int:
        """`tokens` real tokens over steps of at most the largest bucket."""
        top = self.buckets[-1]
        return self.step_cost(top) * (tokens // top) + self.step_cost(tokens % top)

    def chunk(self, used: int, n: int, left_after: int, next_rows: int) -> int:
        """The chunk to schedule instead of `n` tokens, in a step that already holds `used`.
        `left_after`: the request's tokens still to compute after these `n`; `next_rows`: the
        tokens the next step holds anyway (the running requests' decodes)."""
        total = used + n
        i = bisect.bisect_left(self.buckets, total)  # buckets[i - 1] < total <= buckets[i]
        if i == 0 or i == len(self.buckets) or self.buckets[i] == total:
            return n  # no edge below, past the largest bucket, or a bucket exactly
        lo = self.buckets[i - 1]
        if lo <= used:  # the step is past that edge before this chunk
            return n
        over = total - lo
        keep = self.step_cost(total) + self.cost(next_rows + left_after)
        cut = self.step_cost(lo) + self.cost(next_rows + left_after + over)
        return n - over if cut < keep else n
