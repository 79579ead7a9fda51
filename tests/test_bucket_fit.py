"""BucketFit (prefill chunks cut at token-bucket edges) and the scheduler using it; no jax."""
import pytest

from jvllm.config import SchedulerConfig, pow2_buckets
from jvllm.engine.bucket_fit import BucketFit
from jvllm.engine.request import Request
from jvllm.engine.scheduler import Scheduler
from jvllm.memory.block_pool import KVCacheManager
from jvllm.sampling_params import SamplingParams
from tests.helpers import fake_step

GPU = BucketFit(pow2_buckets(8, 2048))


def test_bucket_and_cost():
    assert [GPU.bucket(t) for t in (0, 1, 8, 9, 624, 1024, 2048)] == [0, 8, 8, 16, 1024, 1024, 2048]
    assert GPU.cost(2048 + 100) == 2048 + 128 and GPU.cost(0) == 0
    with pytest.raises(ValueError, match="2049 tokens exceed the largest token bucket 2048"):
        GPU.bucket(2049)  # the lookup the worker's InputLayout shares (config.smallest_bucket)
    with pytest.raises(ValueError, match="ascending"):
        BucketFit((16, 8))
    with pytest.raises(ValueError, match="positive"):
        BucketFit(())


def test_chunk_cut_where_it_pads_less():
    # 40 decodes + a new 584-token prompt: 624 tokens run the 1024 program; cut at 512 the rest
    # (112) joins the next step's 41 rows: 512 + 256 < 1024 + 64
    assert GPU.chunk(40, 584, 0, 40) == 472
    # 40 + 960 = 1000: cut at 512 would leave 488 -> next step 528 in the 1024 program: keep
    assert GPU.chunk(40, 960, 0, 40) == 960
    # exactly a bucket, past the largest one, or the edge below is already used up: unchanged
    assert GPU.chunk(24, 488, 0, 24) == 488
    assert GPU.chunk(0, 4096, 0, 0) == 4096
    assert GPU.chunk(600, 100, 0, 600) == 100
    # the rest of a long prompt goes on anyway: the cut only moves tokens into the next chunk
    assert GPU.chunk(10, 600, 2000, 10) == 502  # 512 + cost(2108) = 512+2048+64 < 1024+2048+16


def test_chunk_never_empties_or_grows():
    for used in range(0, 300, 7):
        for n in range(1, 900, 13):
            for left in (0, 50, 3000):
                c = GPU.chunk(used, n, left, used)
                assert 1 <= c <= n
                if c < n:
                    assert used + c in GPU.buckets


def _req(rid, n, max_tokens=4):  # distinct tokens per request: no prefix-cache hits
    base = 1000 * (sum(map(ord, rid)) + 1)
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0)


@pytest.mark.parametrize("fit", [None, BucketFit(pow2_buckets(8, 512), 128)])
def test_scheduler_cuts_the_last_prefill_chunk(fit):
    kv = KVCacheManager(num_blocks=256, block_size=16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16, max_model_len=1024), kv, fit)
    decoders = [_req(f"d{i}", 8, max_tokens=50) for i in range(10)]
    for r in decoders:
        sched.add(r)
    fake_step(sched)  # 80 prompt tokens: every decoder sampled its first token
    # 10 decodes + 100 = 110 tokens: the 128 program; cut at 64 the next step's 56 tokens cost
    # the flat 128 anyway: no gain, no cut
    sched.add(_req("p", 100))
    out = fake_step(sched)
    assert {s.req.request_id: s.num_tokens for s in out.scheduled}["p"] == 100 and out.num_tokens == 110
    # 11 decodes + 300 = 311: the 512 program; cut at 256, the 55 left and 11 decodes run next
    # (the flat 128 either way): 256 + 128 < 512 + 128
    sched.add(_req("q", 300))
    out = fake_step(sched)
    q = [s for s in out.scheduled if s.req.request_id == "q"][0]
    if fit is None:
        assert q.num_tokens == 300 and q.samples
    else:
        assert q.num_tokens == 245 and out.num_tokens == 256 and not q.samples
        out = fake_step(sched)
        q = [s for s in out.scheduled if s.req.request_id == "q"][0]
        assert q.num_tokens == 55 and q.samples and out.num_tokens == 66
    while sched.has_unfinished():
        fake_step(sched)
    assert all(len(r.output_token_ids) == 50 for r in decoders) and not kv.tables


def test_flat_tokens_keep_small_steps_whole():
    flat = BucketFit(pow2_buckets(8, 2048), 128)
    assert flat.chunk(10, 100, 0, 10) == 100       # 128 program either way
    assert flat.chunk(40, 584, 0, 40) == 472       # 512 + 256 < 1024 + 128
    assert flat.chunk(40, 260, 0, 40) == 216       # 256 + 128 < 512 + 128
    with pytest.raises(ValueError, match="flat_tokens"):
        BucketFit((8,), -1)


def test_cli_flag_reaches_the_engine_config():
    import argparse

    from jvllm.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--fit-chunks-to-buckets"]))["fit_chunks_to_buckets"] is True
    assert engine_kwargs(p.parse_args([]))["fit_chunks_to_buckets"] is False
