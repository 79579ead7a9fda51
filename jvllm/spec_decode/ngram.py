"""N-gram (prompt lookup) proposer, host only (numpy): vLLM's `method="ngram"`.

For n from `prompt_lookup_max` down to `prompt_lookup_min`: if the request's last n tokens occurred
earlier in its tokens (prompt + output), propose the up to k tokens that followed the most recent
earlier occurrence. No match: no proposal (the request runs as a plain row). Deterministic: the
proposal depends only on the token ids, so a preempted request resumes with the same drafts.
"""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, k: int, lookup_min: int, lookup_max: int):
        if not 1 <= lookup_min <= lookup_max:
            raise ValueError(f"ngram lookup sizes need 1 <= min <= max, got min={lookup_min}, max={lookup_max}")
        self.k, self.lo, self.hi = k, lookup_min, lookup_max

    def propose(self, token_ids, max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) draft tokens continuing `token_ids`, or [] when no n-gram matches."""
        k = min(self.k, max_tokens)
        toks = np.asarray(token_ids, np.int64)
        L = len(toks)
        if k <= 0 or L < self.lo + 1:
            return []
        for n in range(min(self.hi, L - 1), self.lo - 1, -1):
            pat = toks[L - n:]
            # windows starting at 0 .. L-n-1: every earlier occurrence (each has a next token)
            win = np.lib.stride_tricks.sliding_window_view(toks[:L - 1], n)
            hits = np.flatnonzero((win == pat).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return [int(t) for t in toks[start:start + k]]
        return []
