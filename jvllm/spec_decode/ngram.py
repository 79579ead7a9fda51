"""N-gram (prompt lookup) proposer, host only (numpy): vLLM's `method="ngram"`.

For n from `prompt_lookup_max` down to `prompt_lookup_min`: if the request's last n tokens occurred
earlier in its tokens (prompt + output), propose the up to k tokens that followed the most recent
earlier occurrence. No match: no proposal (the request runs as a plain row). Deterministic: the
proposal depends only on the token ids, so a preempted request resumes with the same drafts.

A step dispatched ahead of the step in flight (async scheduling) does not know the token that step
samples (its id stays on the device):
- `may_propose_after_pending` says whether `propose` could return drafts once that token x is known
  (for some x; exact);
- `propose_after_pending` proposes without x: it guesses x as the token that followed the most
  recent earlier occurrence of the known tokens' longest suffix of n - 1 tokens (the n-gram ending
  at x less x), and returns what followed x there. A wrong guess only costs acceptance: the target
  verifies every draft, so outputs never depend on the drafts.
"""
from __future__ import annotations

import weakref

import numpy as np


class NgramProposer:
    def __init__(self, k: int, lookup_min: int, lookup_max: int):
        if not 1 <= lookup_min <= lookup_max:
            raise ValueError(f"ngram lookup sizes need 1 <= min <= max, got min={lookup_min}, max={lookup_max}")
        self.k, self.lo, self.hi = k, lookup_min, lookup_max
        # request -> [number of windows indexed, set of (lo-1)-grams that have a known next token]
        self._index: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def propose(self, token_ids, max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) draft tokens continuing `token_ids`, or [] when no n-gram matches."""
        return _lookup(token_ids, min(self.k, max_tokens), self.lo, self.hi)

    def propose_after_pending(self, token_ids, max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) drafts for the positions after one pending token x that follows
        `token_ids`, x guessed (see the module docstring); [] when no suffix of the known tokens
        recurs with two known tokens after it. For x equal to the guess these continue the same
        earlier occurrence `propose(token_ids + [x])` may pick; they can differ from its (a more
        recent occurrence of a shorter n-gram, or a longer n-gram elsewhere)."""
        return self.guess_after_pending(token_ids, max_tokens)[1]

    def guess_after_pending(self, token_ids, max_tokens: int) -> tuple[int | None, list[int]]:
        """(the guessed x, `propose_after_pending`'s drafts), or (None, []) when there are none."""
        k = min(self.k, max_tokens)
        if k <= 0:
            return None, []
        g = _lookup(token_ids, k + 1, max(1, self.lo - 1), max(1, self.hi - 1))
        return (g[0], g[1:]) if len(g) > 1 else (None, [])

    def may_propose_after_pending(self, req) -> bool:
        """Whether `propose(req.all_token_ids + [x], m)` (m >= 1) can be non-empty for SOME token x
        (the one token of `req` now in flight). Exact: a match of n >= lo tokens ending in x
        contains a match of lo tokens ending in x, so one is possible iff the last lo - 1 known
        tokens occur earlier followed by a known token (for lo = 1: any known token). Incremental:
        each call indexes only the windows added since the last one (`req.all_token_ids` only grows;
        requests are held weakly)."""
        toks = req.all_token_ids
        g = self.lo - 1
        if len(toks) < self.lo:  # with x: fewer than lo + 1 tokens, propose returns []
            return False
        if g == 0:
            return True
        st = self._index.get(req)
        if st is None:
            st = self._index[req] = [0, set()]
        end = len(toks) - g  # windows starting at 0 .. end-1 have a known next token
        seen = st[1]
        if g == 1:
            seen.update(toks[st[0]:end])
            st[0] = max(st[0], end)
            return toks[-1] in seen
        for i in range(st[0], end):
            seen.add(tuple(toks[i:i + g]))
        st[0] = max(st[0], end)
        return tuple(toks[-g:]) in seen


def _lookup(token_ids, k: int, lo: int, hi: int) -> list[int]:
    """The up to k tokens after the most recent earlier occurrence of the longest suffix of
    `token_ids` of lo..hi tokens; [] when none recurs (or k <= 0)."""
    toks = np.asarray(token_ids, np.int64)
    L = len(toks)
    if k <= 0 or L < lo + 1:
        return []
    for n in range(min(hi, L - 1), lo - 1, -1):
        pat = toks[L - n:]
        # windows starting at 0 .. L-n-1: every earlier occurrence (each has a next token)
        win = np.lib.stride_tricks.sliding_window_view(toks[:L - 1], n)
        hits = np.flatnonzero((win == pat).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return [int(t) for t in toks[start:start + k]]
    return []
