"""The engine's side of speculative decoding (host only, no jax): which requests speculate, their
proposals before a step, and the accepted tokens after it.

A running request speculates in a step when it is decoding (exactly one token not computed: its
last, or the one pending in the step in flight), the batch is at most `disable_by_batch_size`
(running + waiting), and its sampling needs nothing per verified position that the verifier does
not apply: requests with penalties, logit bias, min_tokens, allowed_token_ids / bad_words, logits
processors, structured outputs (a grammar: its mask would have to hold at every verified
position; such requests run as plain rows, never an error), hidden-state capture or steering run
as plain rows in the same batch. Drafts are capped so the request cannot pass max_tokens or
max_model_len.

With n-gram drafts every step can be dispatched ahead of the one in flight (`propose_ahead`, called
by the engine's `dispatch_ahead`). After a plain step, each row that could speculate has one
pending token (sampled by the step in flight, its id on the device), and the proposer drafts the
positions after it with that token guessed (`guess_after_pending`), only for rows where a match is
possible at all (`may_propose_after_pending`, exact and incremental, so rows that cannot match
cost no lookup). After a speculating step (where the runner can move a verified row by its
accepted count on the device: n-gram on one in-process stage, `jvllm.worker.pending_ids`), each
greedy verified row runs its pending token with drafts guessed as if every draft of the verify step
were accepted, unless those drafts were themselves guessed on tokens now known to be wrong
(`spec_premise`, `holds`): a guess on a guess that failed would cost acceptance on every later
step. The verifier makes a wrong guess cost acceptance only. Otherwise (a draft model, which needs
the pending token itself; sampled verified rows) a step whose rows could speculate waits for the
step before it.
"""
from __future__ import annotations

from jvllm.spec_decode.config import SpeculativeConfig
from jvllm.spec_decode.metrics import SpecStats


def _clear(scheduler):
    for r in scheduler.running:
        r.spec_token_ids = []
        r.spec_premise = None


def holds(premise, token_ids) -> bool:
    """Whether the tokens a proposal assumed (`Request.spec_premise`) are the ones now known."""
    if premise is None:
        return True
    n, assumed = premise
    return tuple(token_ids[n:n + len(assumed)]) == assumed


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

    def propose_ahead(self, scheduler, prev_scheduled, drafts: bool = True, skip=frozenset()) -> bool:
        """Set every running request's `spec_token_ids` for a step dispatched ahead of the step
        `prev_scheduled` (in flight). A candidate decodes after `prev` (computed = its tokens +
        pending - 1, plus the drafts it has in `prev`), is speculable and has budget left even if
        `prev` accepts every draft. With its token in flight it gets `guess_after_pending` drafts
        (the pending token guessed too; `spec_premise` records what they assume): after `prev`'s
        drafts as if all were accepted when those were proposed on what is now known to be its
        tokens (`holds`), else after its known tokens where `may_propose_after_pending` allows a
        match. Without one it gets `propose`'s (its tokens are all known). Returns False, with
        every draft cleared, when the step should wait for `prev` instead: a candidate and a
        proposer that cannot draft past a pending token (a draft model). Hazard: `active` is judged
        now, before `prev`'s finished requests leave (speculation may start a step late).
        `drafts=False`: every row runs plain; `skip`: requests left out."""
        _clear(scheduler)
        if not drafts or not self.active(scheduler):
            return True
        p = self.proposer
        guess = getattr(p, "guess_after_pending", None)
        prev = {id(s.req): s for s in prev_scheduled}
        for r in scheduler.running:
            pend = r.num_pending
            s = prev.get(id(r))
            d = len(s.spec_token_ids) if s is not None else 0
            after = s.start + s.num_tokens if s is not None else r.num_computed_tokens
            if r in skip or after != r.num_tokens + pend - 1 + d or not speculable(r):
                continue
            b = self.budget(r, pend + d)
            if b <= 0:
                continue
            if guess is None or pend > 1:
                _clear(scheduler)
                return False
            if not pend:
                r.spec_token_ids = p.propose(p.ids(r), b)
                continue
            if d and holds(s.premise, r.all_token_ids):
                extra = s.spec_token_ids
            elif p.may_propose_after_pending(r):
                extra = []
            else:
                continue
            x, r.spec_token_ids = guess(p.ids(r, extra), b)
            if r.spec_token_ids:
                r.spec_premise = (r.num_tokens, tuple(extra) + (x,))
        return True

    def candidates(self, scheduler) -> list:
        return [r for r in scheduler.running
                if r.num_pending == 0 and r.num_computed_tokens == r.num_tokens - 1 and speculable(r)
                and self.budget(r) > 0]

    def propose(self, scheduler):
        """Set `spec_token_ids` of every running request for the coming step ([] for those that do
        not speculate). Returns the draft model's (probabilities, {request_id: row}) for the
        verifier, or None (n-gram: one-hot drafts)."""
        _clear(scheduler)
        if not self.active(scheduler):
            return self.proposer.idle(scheduler.running) if hasattr(self.proposer, "idle") else None
        reqs = self.candidates(scheduler)
        if hasattr(self.proposer, "propose_batch"):
            return self.proposer.propose_batch(reqs, [self.budget(r) for r in reqs], scheduler.running)
        for r in reqs:
            r.spec_token_ids = self.proposer.propose(self.proposer.ids(r), self.budget(r))
        return None

    def emitted(self, s, res) -> list[int]:
        """The new tokens of a verified row (accepted drafts + the target's token)."""
        a = res.num_accepted
        if a > len(s.spec_token_ids):
            raise RuntimeError(f"request {s.req.request_id}: verifier accepted {a} of {len(s.spec_token_ids)} drafts")
        return [int(t) for t in res.tokens[:a + 1]]
