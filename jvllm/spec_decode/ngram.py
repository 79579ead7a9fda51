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
        self._ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> [buffer, length]

    def ids(self, req, extra=()) -> np.ndarray:
        """`req.all_token_ids` (then `extra`) as an int32 array, kept per request and extended by
        the tokens appended since the last call (`all_token_ids` only grows), so a lookup does not
        convert the whole list each step. `extra` is written past the kept tokens, not kept: the
        returned view is valid until the next call for this request."""
        toks = req.all_token_ids
        L, e = len(toks), len(extra)
        st = self._ids.get(req)
        if st is None:
            st = self._ids[req] = [np.empty(max(64, 2 * (L + e)), np.int32), 0]
        buf, n = st
        if L + e > len(buf):
            buf = st[0] = np.resize(buf, 2 * (L + e))
        if L > n:
            buf[n:L] = toks[n:]
            st[1] = L
        buf[L:L + e] = extra
        return buf[:L + e]

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
    `token_ids` (a list or an int array) of lo..hi tokens; [] when none recurs (or k <= 0). One
    pass over the tokens finds the earlier occurrences of the last token; the longer suffixes are
    then checked at those positions only."""
    toks = np.asarray(token_ids)
    L = len(toks)
    if k <= 0 or L < lo + 1:
        return []
    top = min(hi, L - 1)
    ends = np.flatnonzero(toks[:L - 1] == toks[L - 1])  # where an earlier window may end (ascending)
    if not len(ends):
        return []
    matched = np.ones(len(ends), np.int64)              # suffix tokens matched backwards from each end
    alive = np.ones(len(ends), bool)
    for d in range(1, top):
        at = ends - d
        alive &= at >= 0
        alive[alive] = toks[at[alive]] == toks[L - 1 - d]
        if not alive.any():
            break
        matched += alive
    for n in range(top, lo - 1, -1):
        hit = np.flatnonzero(matched >= n)
        if len(hit):
            j = int(ends[hit[-1]])                        # the most recent window of n tokens ends at j
            return [int(t) for t in toks[j + 1:j + 1 + k]]
    return []
