"""The engine's side of speculative decoding (host only, no jax): which requests speculate, their
proposals before a step, and the accepted tokens after it.

A running request speculates in a step when it is decoding (exactly one token not computed, none
pending), the batch is at most `disable_by_batch_size` (running + waiting), and its sampling needs
nothing per verified position that the verifier does not apply: requests with penalties, logit
bias, min_tokens, allowed_token_ids / bad_words, logits processors, structured outputs (a grammar:
its mask would have to hold at every verified position; such requests run as plain rows, never
an error), hidden-state capture or steering run as plain rows in the same batch. Drafts are capped
so the request cannot pass max_tokens or max_model_len.

Speculating steps run on the synchronous path: the next step's drafts and the accepted count of
each row must be on the host before it can be scheduled. Every other step stays on the async path:
the engine's `dispatch_ahead` asks `may_propose_after(scheduler, prev)` and dispatches ahead when no
row could speculate in the step after `prev` (speculation inactive above disable_by_batch_size, or
no n-gram can match whatever token `prev` samples). For n-gram this is exact up to the pending
token: a step dispatched ahead is one the synchronous path would have run without drafts too; a
True may still find no draft once the token is read (that step then runs synchronously, plain).
A draft model always proposes, so with one a candidate row always means the synchronous path.
"""
from __future__ import annotations

from jvllm.spec_decode.config import SpeculativeConfig
from jvllm.spec_decode.metrics import SpecStats


def speculable(req) -> bool:
    p = req.params
    return not (p.needs_extras or p.logits_processors or req.grammar is not None or p.return_hidden_states
                or p.steering)


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, proposer):
        """`proposer`: `NgramProposer` or `DraftProposer` (`propose_batch`)."""
        self.cfg = cfg
        self.proposer = proposer
        self.stats = SpecStats(cfg.k)

    def active(self, scheduler) -> bool:
        lim = self.cfg.disable_by_batch_size
        return lim is None or len(scheduler.running) + len(scheduler.waiting) <= lim

    def budget(self, req, pending: int = 0) -> int:
        """Most drafts `req` may take now (`pending`: once its tokens in flight are appended): one
        step emits up to drafts + 1 tokens."""
        n_out = req.num_output_tokens + pending
        return max(0, min(self.cfg.k, req.max_tokens - n_out - 1, req.length_cap - n_out - 1))

    def may_propose_after(self, scheduler, prev_scheduled) -> bool:
        """Whether `propose`, run once the step `prev_scheduled` (in flight, no drafts in it) has
        been read, could give any running request drafts; False: the step after it can be
        dispatched ahead without losing a draft. A request is a candidate then when it is decoding
        after `prev` (computed = its tokens + pending - 1), speculable and with budget left; with
        its token in flight the proposer says whether a match is possible at all
        (`may_propose_after_pending`), without one it proposes for real. Hazard: `active` is
        judged now, before `prev`'s finished requests leave (speculation may start a step late)."""
        if not self.active(scheduler):
            return False
        after = {id(s.req): s.start + s.num_tokens for s in prev_scheduled}
        exact = getattr(self.proposer, "may_propose_after_pending", None)
        for r in scheduler.running:
            pend = r.num_pending
            if after.get(id(r), r.num_computed_tokens) != r.num_tokens + pend - 1 or not speculable(r):
                continue
            if self.budget(r, pend) <= 0:
                continue
            if exact is None or pend > 1:  # a draft model always proposes
                return True
            if exact(r) if pend else bool(self.proposer.propose(r.all_token_ids, self.budget(r))):
                return True
        return False

    def candidates(self, scheduler) -> list:
        return [r for r in scheduler.running
                if r.num_pending == 0 and r.num_computed_tokens == r.num_tokens - 1 and speculable(r)
                and self.budget(r) > 0]

    def propose(self, scheduler):
        """Set `spec_token_ids` of every running request for the coming step ([] for those that do
        not speculate). Returns the draft model's (probabilities, {request_id: row}) for the
        verifier, or None (n-gram: one-hot drafts)."""
        for r in scheduler.running:
            r.spec_token_ids = []
        if not self.active(scheduler):
            return self.proposer.idle(scheduler.running) if hasattr(self.proposer, "idle") else None
        reqs = self.candidates(scheduler)
        if hasattr(self.proposer, "propose_batch"):
            return self.proposer.propose_batch(reqs, [self.budget(r) for r in reqs], scheduler.running)
        for r in reqs:
            r.spec_token_ids = self.proposer.propose(r.all_token_ids, self.budget(r))
        return None

    def emitted(self, s, res) -> list[int]:
        """The new tokens of a verified row (accepted drafts + the target's token)."""
        a = res.num_accepted
        if a > len(s.spec_token_ids):
            raise RuntimeError(f"request {s.req.request_id}: verifier accepted {a} of {len(s.spec_token_ids)} drafts")
        return [int(t) for t in res.tokens[:a + 1]]
