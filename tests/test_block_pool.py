"""Exact tests of the host-side block pool, KV cache manager and scheduler (no jax involved)."""
import sys

import pytest

from jvllm.config import SchedulerConfig
from jvllm.engine.request import Request, Status
from jvllm.engine.scheduler import Scheduler
from jvllm.memory.block_pool import BlockPool, FreeQueue, KVCacheManager, hash_block
from jvllm.sampling_params import SamplingParams
from tests.helpers import fake_step


def req(rid, ids, **kw):
    return Request(rid, ids, SamplingParams(max_tokens=kw.pop("max_tokens", 4), **kw), seed=0)


def test_host_side_does_not_import_jax():
    assert "jax" not in sys.modules or True  # jax may be loaded by other tests; check the modules' imports
    import jvllm.engine.scheduler as s
    import jvllm.memory.block_pool as b

    for mod in (b, s):
        assert "import jax" not in open(mod.__file__).read()


def test_free_queue_order_and_remove():
    pool = BlockPool(6)
    assert pool.free.ids() == [1, 2, 3, 4, 5]  # null block 0 never free
    a = pool.allocate(2)
    assert [b.id for b in a] == [1, 2] and pool.free.ids() == [3, 4, 5]
    pool.release(reversed(a))  # tail block first
    assert pool.free.ids() == [3, 4, 5, 2, 1]
    pool.touch([pool.blocks[4]])  # cache hit pulls a block out of the middle
    assert pool.free.ids() == [3, 5, 2, 1] and pool.blocks[4].ref_cnt == 1
    with pytest.raises(RuntimeError, match="need 5 KV blocks, 4 free"):
        pool.allocate(5)


def test_free_queue_empty():
    q = FreeQueue([])
    with pytest.raises(RuntimeError):
        q.popleft()


def test_prefix_cache_hits_and_lru_eviction():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    r1 = req("a", list(range(10)))  # 2 full blocks + 2 tokens
    hits, n = kv.get_computed_blocks(r1)
    assert hits == [] and n == 0
    assert kv.allocate_slots(r1, 10)
    assert kv.block_ids(r1) == [1, 2, 3]
    r1.num_computed_tokens = 10
    kv.cache_full_blocks(r1, 10)
    assert set(kv.pool.cached) == {hash_block(None, [0, 1, 2, 3]),
                                   hash_block(hash_block(None, [0, 1, 2, 3]), [4, 5, 6, 7])}
    kv.free(r1)
    assert kv.pool.free.ids() == [4, 5, 3, 2, 1]
    # same prefix, different tail: both full blocks hit, even though they are free
    r2 = req("b", list(range(8)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(r2)
    assert [b.id for b in hits] == [1, 2] and n == 8
    assert kv.allocate_slots(r2, 3, hits)
    assert kv.block_ids(r2) == [1, 2, 4]
    assert kv.pool.free.ids() == [5, 3]
    # a prompt of exactly 2 blocks reuses only 1 (one token must be computed for its logits)
    r3 = req("c", list(range(8)))
    hits, n = kv.get_computed_blocks(r3)
    assert [b.id for b in hits] == [1] and n == 4
    assert kv.pool.prefix_hits == 12 and kv.pool.prefix_queries == 10 + 11 + 8
    # eviction: allocating block 3 (cached? no: partial) then ... fill the pool to evict nothing cached
    kv.free(r2)
    assert kv.pool.free.ids() == [5, 3, 4, 2, 1]
    kv.pool.allocate(4)  # takes 5, 3, 4, 2: block 2's hash is evicted, block 1 keeps its hash
    assert hash_block(None, [0, 1, 2, 3]) in kv.pool.cached
    assert len(kv.pool.cached) == 1


def test_allocate_slots_fails_atomically():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = req("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)  # needs 3 blocks, 2 usable
    assert kv.pool.num_free == 2 and kv.block_ids(r) == []


def _drive(sched, kv, steps=100):
    """Run the scheduler with fake sampling (token = 7) until everything finishes."""
    order = []
    for _ in range(steps):
        out = fake_step(sched)
        if out.empty:
            break
        order.append([(s.req.request_id, s.num_tokens) for s in out.scheduled])
    return order


def test_scheduler_chunked_prefill_and_decode_first():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64), kv)
    a, b = req("a", list(range(5)), max_tokens=3), req("b", list(range(100, 120)), max_tokens=2)
    sched.add(a)
    sched.add(b)
    order = _drive(sched, kv)
    assert order[0] == [("a", 5), ("b", 3)]         # a whole, b's first chunk
    assert order[1] == [("a", 1), ("b", 7)]         # a decodes first, then b's next chunk
    assert order[2] == [("a", 1), ("b", 7)]
    assert order[3] == [("b", 3), ]                 # a finished (3 tokens); b's last chunk samples
    assert order[4] == [("b", 1)]
    assert a.output_token_ids == [7, 7, 7] and b.output_token_ids == [7, 7]
    assert kv.pool.num_free == 31 and not kv.tables
    assert {a.microbatch, b.microbatch} == {0}  # num_microbatches=1 (no stages): one plain budget


def test_scheduler_preempts_newest_and_resumes():
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_caching=False)  # 4 usable blocks
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64), kv)
    a, b = req("a", list(range(7)), max_tokens=6), req("b", list(range(50, 57)), max_tokens=6)
    sched.add(a)
    sched.add(b)
    _drive(sched, kv)
    assert sched.num_preemptions >= 1 and b.metrics.num_preemptions >= 1 and a.metrics.num_preemptions == 0
    assert a.output_token_ids == [7] * 6 and b.output_token_ids == [7] * 6
    assert kv.pool.num_free == 4 and not kv.tables


def test_abort_returns_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64), kv)
    a = req("a", list(range(9)))
    sched.add(a)
    out = sched.schedule()
    sched.update_after_step(out)
    assert kv.pool.num_free == 6
    sched.finish(a, Status.FINISHED_ABORTED)
    assert kv.pool.num_free == 9 and not sched.has_unfinished()


def test_n_siblings_share_prompt_blocks():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64), kv)
    sib = [Request(f"{i}_x", list(range(9)), SamplingParams(max_tokens=2), seed=i, group_id="x", index=i)
           for i in range(3)]
    for s in sib:
        sched.add(s)
    first = sched.schedule()
    assert [s.req.request_id for s in first.scheduled] == ["0_x"]  # siblings wait for the prompt's blocks
    sched.update_after_step(first)
    sib[0].append_token(5, None, None)  # the engine appends the sampled token before the next step
    second = sched.schedule()
    tables = {s.req.request_id: s.block_ids for s in second.scheduled}
    assert tables["1_x"][:2] == tables["0_x"][:2] == tables["2_x"][:2]
    assert [s.num_tokens for s in second.scheduled[1:]] == [1, 1]  # only the last prompt token computed


def test_schedule_ahead_counts_pending_tokens_skips_and_never_preempts():
    """Scheduling while a step is in flight (async scheduling): a pending token counts as a token
    to compute, `skip` leaves requests out, and without preemption the step ends where blocks run out."""
    kv = KVCacheManager(num_blocks=6, block_size=4)  # 5 usable blocks
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64), kv)
    a = Request("a", list(range(8)), SamplingParams(max_tokens=8), seed=0)
    b = Request("b", list(range(10, 18)), SamplingParams(max_tokens=8), seed=1)
    for r in (a, b):
        sched.add(r)
    first = sched.schedule()
    assert [(s.req.request_id, s.num_tokens, s.samples) for s in first.scheduled] == [("a", 8, True), ("b", 8, True)]
    assert kv.pool.num_free == 1
    sched.update_after_step(first)
    a.num_pending = b.num_pending = 1          # step 1 dispatched, its tokens still on the device
    nxt = sched.schedule(skip=frozenset({b}), allow_preempt=False)
    assert [(s.req.request_id, s.start, s.num_tokens, s.samples) for s in nxt.scheduled] == [("a", 8, 1, True)]
    assert kv.pool.num_free == 0 and not nxt.preempted
    sched.update_after_step(nxt)
    a.num_pending = 2                          # a samples in both steps in flight
    ahead = sched.schedule(allow_preempt=False)  # a fits in its 3rd block; b needs one more: none left
    assert [(s.req.request_id, s.start) for s in ahead.scheduled] == [("a", 9)]
    assert not ahead.preempted and sched.num_preemptions == 0 and b.status is Status.RUNNING
    sync = sched.schedule()                    # the synchronous path preempts the newest instead
    assert [r.request_id for r in sync.preempted] == ["b"] and b.status is Status.PREEMPTED


def test_scheduler_microbatches_budget_each_and_keep_members():
    """Pipeline micro-batches: the budget is per micro-batch (a chunk is cut to what its micro-batch
    has left), a new request joins the micro-batch with the fewest running requests, a request
    keeps its micro-batch while running, and preemption frees it to join another."""
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64,
                                      num_microbatches=2), kv)
    a, b, c = req("a", list(range(6)), max_tokens=4), req("b", list(range(20, 32)), max_tokens=4), \
        req("c", list(range(40, 43)), max_tokens=4)
    for r in (a, b, c):
        sched.add(r)
    out = sched.schedule()
    got = [(s.req.request_id, s.req.microbatch, s.num_tokens) for s in out.scheduled]
    # a -> mb 0 (6 of 8), b -> mb 1 (cut to 8), c -> mb 0 (its 2 remaining tokens of 3)
    assert got == [("a", 0, 6), ("b", 1, 8), ("c", 0, 2)]
    assert out.num_tokens == 16
    for mb in (0, 1):
        assert sum(s.num_tokens for s in out.scheduled if s.req.microbatch == mb) <= 8
    sched.update_after_step(out)
    a.append_token(7, None, None)
    nxt = sched.schedule()
    assert [(s.req.request_id, s.req.microbatch, s.num_tokens) for s in nxt.scheduled] == \
        [("a", 0, 1), ("b", 1, 4), ("c", 0, 1)]
    with pytest.raises(ValueError, match="num_microbatches"):
        SchedulerConfig(num_microbatches=0)
    sched._preempt(b)
    assert b.microbatch is None and b.status is Status.PREEMPTED
