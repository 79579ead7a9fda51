"""Host inputs of the spec_verify program (numpy) and its per-row results.

A speculating row of a step has its real token then its d drafts as its last d + 1 scheduled
tokens; their flat positions in the step are the verified positions (`idx`, padded with the last
one up to k + 1). Rows without drafts get d = 0 (their one verified position is their last token;
the engine reads their token from the ordinary sampler, not from here).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jvllm.sampling import SamplingBatch
from jvllm.worker.sampler import key_data


@dataclasses.dataclass
class VerifyInputs:
    idx: np.ndarray          # [R, k+1] int32 flat positions verified per row
    draft: np.ndarray        # [R, k] int32 draft ids (0 padding)
    num_draft: np.ndarray    # [R] int32
    sb: SamplingBatch        # numpy, the rows' sampling parameters (counter: index of the first new token)
    q_rows: np.ndarray | None  # [R] int32 row of each row in the draft model's probabilities, or None
    want_lp: bool


@dataclasses.dataclass
class SpecRowResult:
    tokens: np.ndarray       # [k+1] int32: the first num_accepted + 1 are the row's new tokens
    num_accepted: int
    logprobs: tuple | None   # (tok_lp [k+1], rank [k+1], top ids [k+1, N], top lp [k+1, N]) or None


def verify_inputs(sched, R: int, k: int, vocab_size: int, q_rows: dict | None = None) -> VerifyInputs:
    """`sched`: the micro-batch's ScheduledRequests in row order; `q_rows`: {request_id: row of the
    draft model's probabilities} (draft-model proposer) or None (one-hot drafts)."""
    if len(sched) > R:
        raise ValueError(f"{len(sched)} rows exceed the request bucket {R}")
    idx = np.zeros((R, k + 1), np.int32)
    draft = np.zeros((R, k), np.int32)
    nd = np.zeros(R, np.int32)
    temp = np.zeros(R, np.float32)
    top_k = np.full(R, vocab_size, np.int32)
    top_p = np.ones(R, np.float32)
    min_p = np.zeros(R, np.float32)
    keys = np.zeros((R, 2), np.uint32)
    counter = np.zeros(R, np.int32)
    qr = None if q_rows is None else np.zeros(R, np.int32)
    want_lp = False
    off = 0
    for r, s in enumerate(sched):
        d = len(s.spec_token_ids)
        if d > k:
            raise ValueError(f"request {s.req.request_id}: {d} drafts exceed num_speculative_tokens {k}")
        last = off + s.num_tokens - 1
        first = last - d
        idx[r] = np.minimum(np.arange(first, first + k + 1), last)
        draft[r, :d] = s.spec_token_ids
        nd[r] = d
        p = s.req.params
        if d:
            temp[r] = 0.0 if p.greedy else p.temperature
            top_k[r] = vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size)
            top_p[r], min_p[r] = p.top_p, p.min_p
            keys[r] = key_data(s.req.seed)
            counter[r] = s.req.num_output_tokens + s.req.num_pending
            want_lp |= p.logprobs is not None
            if qr is not None:
                qr[r] = q_rows[s.req.request_id]
        off += s.num_tokens
    sb = SamplingBatch(temp, top_k, top_p, min_p, keys, counter, np.bool_(want_lp))
    return VerifyInputs(idx, draft, nd, sb, qr, want_lp)
