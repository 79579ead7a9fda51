"""Draft-model proposer: a second model (any model jvllm loads, the target's tokenizer) with its own
model runner and KV pool, proposing k tokens per request in k rounds of ragged steps.

Per proposal call, for the requests that speculate:
  round 0   a ragged step over each request's tokens the draft has not computed yet (its whole
            prompt the first time, afterwards the one or two tokens after the last verification),
            cut to the largest token bucket: a request whose backlog does not fit catches up over
            several calls and proposes nothing until it has
  round j   one token per request: the draft token of round j - 1, taken on the device from the
            previous round's sampled ids (never through the host)
Each round's `draft_sample` program writes the draft token and the draft's distribution q (the
target row's temperature / top_k / top_p / min_p applied; one-hot for greedy rows) into device
accumulators [max_num_seqs, k, V]; the verifier reads q there. One host read per call (the k draft
ids, needed as the target's input tokens).

Draft KV validity is kept by token ids: after a call the draft holds the request's tokens plus its
first m - 1 drafts; at the next call the prefix of those drafts that the request actually kept
stays, the rest is given back (`KVCacheManager.trim`). Requests that left the running set
(finished, aborted, preempted) have their draft blocks freed. A request the draft pool has no room
for proposes nothing in that step (never an error, never a preemption).

The draft pool has as many blocks as the target's (the engine sizes both together). The draft's
activation peak is not part of the target's sizing: a hazard with very large drafts.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jvllm.sampling import SamplingBatch
from jvllm.worker.sampler import key_data


@dataclasses.dataclass
class _DraftSeq:
    """A request as the draft's KVCacheManager sees it."""
    request_id: str
    num_computed_tokens: int = 0
    base: int = 0                    # request length when the drafts in `fed` were proposed
    fed: list = dataclasses.field(default_factory=list)  # drafts whose KV the draft pool holds after `base`
    block_hashes: list = dataclasses.field(default_factory=list)
    all_token_ids: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Row:
    """One row of a draft step, in the shape `InputLayout.prepare` reads."""
    req: object
    num_tokens: int
    start: int
    block_ids: list
    spec_token_ids: tuple = ()


def check_same_vocab(target_tok, draft_tok, target_vocab: int, draft_vocab: int, draft_name: str):
    """The draft must share the target's tokenizer (same vocabulary: token ids mean the same text)
    and logit width; raises ValueError naming what differs."""
    if target_vocab != draft_vocab:
        raise ValueError(f"speculative_config: draft model {draft_name!r} has vocab_size {draft_vocab}, the target "
                         f"{target_vocab}; the draft must share the target's tokenizer and vocabulary")
    if (target_tok is None) != (draft_tok is None):
        raise ValueError(f"speculative_config: draft model {draft_name!r} {'has' if draft_tok else 'ships'} "
                         f"{'a tokenizer' if draft_tok else 'no tokenizer'} and the target "
                         f"{'has one' if target_tok else 'has none'}: cannot check they share the vocabulary")
    if target_tok is not None:
        tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
        if tv != dv:
            diff = sorted(set(tv.items()) ^ set(dv.items()))[:3]
            raise ValueError(f"speculative_config: draft model {draft_name!r} has a different tokenizer vocabulary "
                             f"({len(dv)} vs the target's {len(tv)} entries; e.g. {diff})")


class DraftProposer:
    def __init__(self, cfg, engine_config, target_model_config, target_tokenizer):
        """Load the draft's weights and check its vocabulary (before the target's KV pool is
        sized: `kv_bytes_per_block` goes into that sizing); `build` makes the pool and runner."""
        from jvllm.worker.worker import Worker

        self.k = cfg.k
        dc = dataclasses.replace(engine_config, model=cfg.model, speculative_config=None, skip_tokenizer_init=None,
                                 logits_processors=None, num_gpu_blocks_override=None, kv_cache_memory_bytes=None)
        self.worker = Worker(dc, None)
        self.worker.load()
        tok = self.worker.tokenizer()
        check_same_vocab(target_tokenizer, tok, target_model_config.vocab_size, self.worker.model_config.vocab_size,
                         cfg.model)
        self.name = cfg.model

    def kv_bytes_per_block(self) -> int:
        return self.worker.kv_bytes_per_block()

    def build(self, sched_config, cache_config, buckets, num_blocks: int, use_tqdm: bool = False):
        """The draft's runner and pool (`num_blocks`, block size as the target's), compiled now."""
        import jax.numpy as jnp

        from jvllm.config import CacheConfig
        from jvllm.memory.block_pool import KVCacheManager

        cc = CacheConfig(block_size=cache_config.block_size, num_blocks=num_blocks, enable_prefix_caching=False)
        self.worker.build_runner(sched_config, cc, buckets)
        r = self.runner = self.worker.runner
        r.draft_k = self.k
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, enable_caching=False)
        self.seqs: dict[str, _DraftSeq] = {}
        S, V = r.max_num_seqs, r.cfg.vocab_size
        self.acc_p = jnp.zeros((S, self.k, V), jnp.float32)
        self.acc_i = jnp.zeros((S, self.k), jnp.int32)
        keys = [k for k in r.programs.keys() if k[0] in ("step", "draft_sample")]
        r.programs.warm_up(keys).wait()

    def release(self):
        self.worker.release()

    # ------------------------------------------------------------------ proposing
    def _sync(self, req) -> _DraftSeq:
        """The request's draft state, with KV of drafts the request did not keep given back."""
        st = self.seqs.get(req.request_id)
        if st is None:
            st = self.seqs[req.request_id] = _DraftSeq(req.request_id)
        toks = req.all_token_ids
        c = 0
        while c < len(st.fed) and st.base + c < len(toks) and toks[st.base + c] == st.fed[c]:
            c += 1
        keep = min(st.base + c if st.fed else st.num_computed_tokens, len(toks) - 1)
        st.num_computed_tokens = min(st.num_computed_tokens, keep)
        st.fed, st.base = [], st.num_computed_tokens
        self.kv.trim(st, st.num_computed_tokens)
        return st

    def idle(self, running):
        self._forget(running)
        return None

    def _forget(self, running):
        live = {r.request_id for r in running}
        for rid in [rid for rid in self.seqs if rid not in live]:
            self.kv.free(self.seqs.pop(rid))

    def _sampling(self, rows, reqs, R: int, j: int, dst: list[int]):
        V = self.runner.cfg.vocab_size
        temp = np.zeros(R, np.float32)
        top_k = np.full(R, V, np.int32)
        top_p = np.ones(R, np.float32)
        min_p = np.zeros(R, np.float32)
        keys = np.zeros((R, 2), np.uint32)
        counter = np.zeros(R, np.int32)
        d = np.full(R, -1, np.int32)
        for i, req in enumerate(reqs):
            p = req.params
            temp[i] = 0.0 if p.greedy else p.temperature
            top_k[i] = V if p.top_k <= 0 else min(p.top_k, V)
            top_p[i], min_p[i] = p.top_p, p.min_p
            keys[i] = key_data(req.seed)
            counter[i] = req.num_output_tokens + j
            d[i] = dst[i]
        return SamplingBatch(temp, top_k, top_p, min_p, keys, counter, np.bool_(False)), d

    def _run(self, rows, reqs, dst, j: int, tok_in, prev_rows):
        from jvllm.worker.stage import put

        r = self.runner
        st = r.stages[0]
        ps = r.layout.prepare(rows, prev_rows=prev_rows)
        packed = put(r.layout.pack(ps), st.sharding())
        out = r.programs.get("step", (0, ps.T, ps.decode))(st.params(), st.kv, packed, tok_in)
        st.kv = out[0]
        sb, d = self._sampling(rows, reqs, ps.R, j, dst)
        greedy = bool(not np.any(sb.temperature > 0))
        self.acc_p, self.acc_i, tok_pad = r.programs.get("draft_sample", (ps.R, greedy))(
            r.head_w, out[1], sb, d, np.int32(j), self.acc_p, self.acc_i)
        return tok_pad

    def propose_batch(self, reqs, budgets, running):
        """Set `spec_token_ids` of `reqs` (up to budgets[i] drafts each; [] for a request still
        catching up or without room). Returns (draft probabilities [max_num_seqs, k, V] on device,
        {request_id: row}) for the verifier, or None when nothing was proposed."""
        self._forget(running)
        cap = self.runner.token_buckets[-1]
        rows, rreqs, dst, plan = [], [], [], []
        used = 0
        for req, m in zip(reqs, budgets):
            st = self._sync(req)
            back = req.num_tokens - st.num_computed_tokens
            n = min(back, cap - used)
            if n <= 0:
                continue
            ready = n == back and m > 0
            need = n + (m - 1 if ready else 0)
            if not self.kv.allocate_slots(st, need):
                if not ready or not self.kv.allocate_slots(st, n):
                    continue
                ready = False
            rows.append(_Row(_View(req), n, st.num_computed_tokens, self.kv.block_ids(st)))
            rreqs.append(req)
            dst.append(len(plan) if ready else -1)
            if ready:
                plan.append((req, st, m))
            st.num_computed_tokens += n
            st.base = st.num_computed_tokens
            used += n
        if not rows:
            return None
        tok_pad = self._run(rows, rreqs, dst, 0, self.runner.no_prev, None)
        prev_rows = {req.request_id: i for i, req in enumerate(rreqs)}
        for j in range(1, self.k):
            live = [(i, req, st) for i, (req, st, m) in enumerate(plan) if m > j]
            if not live:
                break
            rows = [_Row(_View(req), 1, st.num_computed_tokens, self.kv.block_ids(st)) for _, req, st in live]
            tok_pad = self._run(rows, [req for _, req, _ in live], [i for i, _, _ in live], j, tok_pad, prev_rows)
            prev_rows = {req.request_id: n for n, (_, req, _) in enumerate(live)}
            for _, _, st in live:
                st.num_computed_tokens += 1
        if not plan:
            return None
        ids = np.asarray(self.acc_i)
        out = {}
        for i, (req, st, m) in enumerate(plan):
            req.spec_token_ids = [int(t) for t in ids[i, :m]]
            st.fed = req.spec_token_ids[:m - 1]
            out[req.request_id] = i
        return self.acc_p, out


class _View:
    """A request's id and tokens for the draft step's `prepare` (its drafts are pending on device)."""
    __slots__ = ("request_id", "all_token_ids")

    def __init__(self, req):
        self.request_id = req.request_id
        self.all_token_ids = req.all_token_ids
