"""Token-budget scheduler (vLLM v1 style; ../shared/DESIGN.md principle 3). Plain Python, no jax.

Each request has `num_computed_tokens` catching up with `num_tokens` (prompt + sampled outputs).
A step is a budget of `max_num_batched_tokens`: running requests first (a decode is one token, an
unfinished prefill gets its next chunk), then waiting requests FCFS while budget, `max_num_seqs`
and KV blocks last. When a running request cannot get a block, the newest running request is
preempted (its blocks freed, its computed tokens forgotten; it is re-queued at the front of the
waiting queue and recomputed later, prefix cache permitting). Sampling is keyed per request by
(seed, output index), so a preempted request resumes with exactly the output it would have had.

Pipeline micro-batches (`num_microbatches` > 1): each admitted request joins one micro-batch
(`Request.microbatch`: the one with budget left and the fewest running requests; at most
ceil(max_num_seqs / num_microbatches) each, and at most an eighth of that above the emptiest one)
and stays in it until it finishes or is preempted, so its next step's input token is in that
micro-batch's sampled ids (async scheduling). The budget is per micro-batch: a prefill chunk is cut to what its
micro-batch has left, so no micro-batch exceeds `max_num_batched_tokens` (the largest bucket).
(Splitting one whole step into micro-batches afterwards pads each piece to a large bucket and
measured much slower: benchmarks/README.md, History.)
"""
from __future__ import annotations

import collections
import dataclasses
import time

from jvllm.config import SchedulerConfig
from jvllm.engine.bucket_fit import BucketFit
from jvllm.engine.request import Request, Status
from jvllm.memory.block_pool import KVCacheManager


@dataclasses.dataclass
class ScheduledRequest:
    req: Request
    num_tokens: int          # tokens computed this step
    start: int               # position of the first of them
    block_ids: list[int]     # the request's whole block table
    samples: bool = False    # the step's last token is the request's last token: its logits give a new one
    # speculative decoding: draft tokens appended after the request's real tokens (part of
    # num_tokens); the target verifies them and the accepted ones become the request's
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)
    # a verified row whose next step was dispatched before it was read: that step's entry of the
    # request, laid out as if no draft were accepted; `accept_speculated` moves its start
    follow: ScheduledRequest | None = None
    premise: tuple | None = None  # the drafts' `Request.spec_premise`


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    num_tokens: int
    microbatch: int | None = None  # the one micro-batch this step schedules (`only`), else None

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, fit: BucketFit | None = None):
        """`fit`: the runner's token buckets; with it a step's last prefill chunk is cut at a
        bucket edge where that pads less (engine/bucket_fit.py); None: chunks fill the budget."""
        self.cfg = cfg
        self.kv = kv
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.fit = fit
        self.num_bucket_cuts = 0  # prefill chunks `fit` shortened

    # ------------------------------------------------------------------ queue
    def add(self, req: Request):
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: Status):
        """Remove a request (finished, aborted or errored) and return its blocks at once."""
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.status = status
        self.kv.free(req)

    def _preempt(self, req: Request):
        self.running.remove(req)
        self.kv.free(req)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        req.microbatch = None
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        req.spec_token_ids = []
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ schedule
    def _entry(self, req: Request, n: int, start: int, spec: list[int] | None = None) -> ScheduledRequest:
        spec = spec or []
        return ScheduledRequest(req, n, start, self.kv.block_ids(req),
                                samples=start + n == req.num_tokens + req.num_pending + len(spec),
                                spec_token_ids=spec, premise=req.spec_premise if spec else None)

    def schedule(self, skip: frozenset = frozenset(), allow_preempt: bool = True,
                 only: int | None = None) -> SchedulerOutput:
        """`skip`: running requests to leave out of this step (async scheduling: their token in
        flight is their last). A request's length counts its pending token (`num_pending`).
        `allow_preempt=False` (scheduling ahead of a step in flight): when blocks run out the step
        ends there instead of preempting; the requests left out run in a later step.
        `only`: schedule that one micro-batch (its running requests, new ones join it), the others
        keep their steps in flight (the engine's pipelined async loop)."""
        m = self.cfg.num_microbatches
        if only is not None and not 0 <= only < m:
            raise ValueError(f"micro-batch {only} out of range: num_microbatches is {m}")
        budget = [self.cfg.max_num_batched_tokens if only in (None, k) else 0 for k in range(m)]
        cap = -(-self.cfg.max_num_seqs // m)  # running requests per micro-batch, so they stay balanced
        # a micro-batch takes new requests while it is at most `slack` above the emptiest one: with
        # one micro-batch scheduled at a time (`only`) the first would otherwise take every waiting
        # request its budget fits, yet a slack of cap/8 still lets a prefill fill its budget
        slack = -(-cap // 8)
        members = [0] * m  # running requests per micro-batch
        for r in self.running:  # every running request got its micro-batch on admission
            members[r.microbatch] += 1
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        now = time.time()

        i = 0
        starved = False
        while i < len(self.running) and any(budget):
            req = self.running[i]
            g = req.microbatch
            n_real = req.num_tokens + req.num_pending - req.num_computed_tokens
            spec = req.spec_token_ids  # drafts proposed for this step (speculative decoding), else []
            if spec and (req in skip or n_real != 1 or not self.kv.allocate_slots(req, min(1 + len(spec), budget[g]))):
                spec = req.spec_token_ids = []  # no room (blocks or budget): a plain decode instead
            n = min(n_real + len(spec), budget[g])
            if spec:
                spec = req.spec_token_ids = spec[:n - n_real]
            if req in skip or n <= 0:
                i += 1
                continue
            if not allow_preempt and not self.kv.allocate_slots(req, n):
                starved = True
                break
            while allow_preempt and not self.kv.allocate_slots(req, n):
                victim = self.running[-1]
                members[victim.microbatch] -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break  # req itself was preempted: nothing after it can run either
            scheduled.append(self._entry(req, n, req.num_computed_tokens, spec))
            budget[g] -= n
            i += 1

        # n > 1: siblings share the prompt's blocks through the prefix cache, so a sibling is not
        # admitted while another one is computing the prompt (its blocks are cached after the step).
        share = self.kv.pool.enable_caching
        bs = self.kv.block_size

        def full_prompt(r):  # tokens of the prompt that fill whole (shareable) blocks
            return r.num_prompt_tokens // bs * bs

        in_flight_groups = {s.req.group_id for s in scheduled if s.start < full_prompt(s.req)}
        while (self.waiting and any(budget) and len(self.running) < self.cfg.max_num_seqs and not preempted
               and not starved):
            req = self.waiting[0]
            if share and req.group_id in in_flight_groups:
                break
            # the micro-batch with budget and room left and the fewest running requests (then the most budget)
            low = min(members)
            open_ = [k for k in range(m) if budget[k] and members[k] < cap and members[k] - low < slack]
            if not open_:
                break
            g = min(open_, key=lambda k: (members[k], -budget[k], k))
            hits, n_hit = self.kv.get_computed_blocks(req, req.max_prefix_hit_tokens)
            n = min(req.num_tokens - n_hit, budget[g])
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.popleft()
            req.num_computed_tokens = n_hit
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.metrics.num_cached_tokens = n_hit
            req.status = Status.RUNNING
            req.microbatch = g
            members[g] += 1
            self.running.append(req)
            scheduled.append(self._entry(req, n, n_hit))
            if n_hit < full_prompt(req):
                in_flight_groups.add(req.group_id)
            budget[g] -= n
        if self.fit is not None:
            self._fit_last_chunks(scheduled, members)
        used = sum(s.num_tokens for s in scheduled)
        return SchedulerOutput(scheduled, preempted, used, only)

    def _fit_last_chunks(self, scheduled: list[ScheduledRequest], members: list[int]):
        """Per micro-batch, cut its last prefill chunk at a token-bucket edge where BucketFit says
        that pads less. Only shortens a chunk: the blocks already allocated for the longer one
        stay with the request, which needs them for the rest of its prompt."""
        used = collections.Counter()
        last: dict[int, int] = {}
        for k, s in enumerate(scheduled):
            g = s.req.microbatch
            used[g] += s.num_tokens
            if s.num_tokens > 1 and not s.spec_token_ids:
                last[g] = k
        for g, k in last.items():
            s = scheduled[k]
            req = s.req
            left_after = req.num_tokens + req.num_pending - (s.start + s.num_tokens)
            n = self.fit.chunk(used[g] - s.num_tokens, s.num_tokens, left_after, max(0, members[g] - 1))
            if n != s.num_tokens:
                scheduled[k] = self._entry(req, n, s.start)
                self.num_bucket_cuts += 1

    def update_after_step(self, out: SchedulerOutput):
        """Advance computed counts and register newly full blocks in the prefix cache. Draft tokens
        do not count here: `accept_speculated` counts the accepted ones once they are known."""
        for s in out.scheduled:
            req = s.req
            if req.status is not Status.RUNNING:
                continue
            req.num_computed_tokens = s.start + s.num_tokens - len(s.spec_token_ids)
            self.kv.cache_full_blocks(req, req.num_computed_tokens)

    def accept_speculated(self, s: ScheduledRequest, num_accepted: int):
        """After a verified step (and after the accepted drafts and the one new token were
        appended to the request): the accepted drafts' KV slots count as computed, the rejected
        drafts' are given back. Blocks that hold only rejected tokens return to the pool; only
        blocks full of accepted tokens get prefix-cache hashes (their hashes are over the real
        token ids, appended before this call). A `follow` entry (the request's row in the step
        dispatched ahead, its tokens in flight) moves by the accepted count, and the blocks of those
        tokens' slots are kept."""
        req = s.req
        d = len(s.spec_token_ids)
        if not 0 <= num_accepted <= d:
            raise ValueError(f"request {req.request_id}: {num_accepted} drafts accepted of {d} proposed")
        if req.status is not Status.RUNNING:
            return
        req.num_computed_tokens = s.start + s.num_tokens - d + num_accepted
        if req.num_computed_tokens >= req.num_tokens:
            raise RuntimeError(f"request {req.request_id}: {req.num_computed_tokens} tokens computed of "
                               f"{req.num_tokens}; the token after the accepted drafts must be appended first")
        keep = req.num_computed_tokens
        if s.follow is not None:
            s.follow.start += num_accepted
            keep = s.follow.start + s.follow.num_tokens  # its tokens (drafts too) are being written
        self.kv.trim(req, keep)
        self.kv.cache_full_blocks(req, req.num_computed_tokens)
