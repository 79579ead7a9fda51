"""Speculative decoding pieces without an engine: config parsing, the n-gram proposer, the
scheduler's roll-back of rejected drafts, the counters, and the rejection sampler's output
distribution (chi-square against the target's distribution over many seeds)."""
from __future__ import annotations

import numpy as np
import pytest

from jvllm.spec_decode.config import SpeculativeConfig
from jvllm.spec_decode.metrics import SpecStats
from jvllm.spec_decode.ngram import NgramProposer


# ---------------------------------------------------------------------------- config
def test_config_parses_vllm_dicts():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                     "prompt_lookup_min": 2})
    assert (c.method, c.k, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 2, 4)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.from_dict({"model": "some/draft", "num_speculative_tokens": 3, "disable_by_batch_size": 8})
    assert (c.method, c.model, c.disable_by_batch_size, c.uses_draft_model) == ("draft_model", "some/draft", 8, True)


@pytest.mark.parametrize("d, match", [
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
    ({"method": "eagle", "num_speculative_tokens": 2, "model": "x"}, "'eagle' is not implemented"),
    ({"method": "nope", "num_speculative_tokens": 2}, "unknown method 'nope'"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "1..16"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, r"prompt_lookup_min \(4\) > prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no draft model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a draft 'model'"),
    ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "ngram option"),
    ({"num_speculative_tokens": 2}, "needs a 'method'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_config_errors_name_the_value(d, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(d)


def test_config_needs_a_dict():
    with pytest.raises(TypeError, match="must be a dict"):
        SpeculativeConfig.from_dict('{"method": "ngram"}')


# ---------------------------------------------------------------------------- n-gram
def test_ngram_proposes_the_continuation_of_the_latest_match():
    p = NgramProposer(k=3, lookup_min=1, lookup_max=3)
    assert p.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]  # latest earlier occurrence of 1 2 3
    assert p.propose([1, 2, 3, 4, 2, 3], 3) == [4, 2, 3]
    assert p.propose([1, 2, 3, 4, 2, 3], 1) == [4]          # capped by the request's budget
    assert p.propose([1, 2, 3, 4, 5], 3) == []               # no n-gram repeats
    assert p.propose([5], 3) == []
    assert p.propose([1, 2, 1], 3) == [2, 1]                 # a continuation shorter than k
    longer = NgramProposer(k=2, lookup_min=2, lookup_max=2)
    assert longer.propose([1, 2, 3, 4, 2], 2) == []          # a 1-gram match is below lookup_min
    with pytest.raises(ValueError, match="min=3, max=2"):
        NgramProposer(2, 3, 2)


def _windowed_lookup():
    """The lookup by definition (every window of n tokens compared, n from hi down to lo): the
    windowed function of benchmarks/probes/ngram_lookup.py, the proposer before 0bdf5f9."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes", "ngram_lookup.py")
    spec = importlib.util.spec_from_file_location("ngram_lookup_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.windowed


def test_ngram_lookup_equals_the_windowed_definition():
    """The candidate-position lookup returns what comparing every window returns, on random short
    sequences over tiny vocabularies (many overlapping and nested matches)."""
    from jvllm.spec_decode.ngram import _lookup

    ref = _windowed_lookup()
    rng = np.random.default_rng(1)
    for _ in range(3000):
        toks = [int(t) for t in rng.integers(0, int(rng.integers(1, 5)), int(rng.integers(0, 30)))]
        lo = int(rng.integers(1, 4))
        hi, k = int(rng.integers(lo, 6)), int(rng.integers(0, 6))
        assert _lookup(toks, k, lo, hi) == ref(toks, k, lo, hi), (toks, k, lo, hi)
        assert _lookup(np.asarray(toks, np.int32), k, lo, hi) == ref(toks, k, lo, hi)


def test_ngram_token_array_follows_the_request():
    """`ids(req)` is the request's tokens as an array, extended as tokens are appended (kept per
    request), with `extra` ids after them on request."""
    p = NgramProposer(k=3, lookup_min=1, lookup_max=2)
    r = _Req(list(range(10)))
    np.testing.assert_array_equal(p.ids(r), np.arange(10))
    r.all_token_ids += list(range(100, 300))
    np.testing.assert_array_equal(p.ids(r), list(range(10)) + list(range(100, 300)))
    np.testing.assert_array_equal(p.ids(r, [7, 8]), list(range(10)) + list(range(100, 300)) + [7, 8])
    assert len(p.ids(r)) == 210  # extra is not kept
    r.all_token_ids += [50]  # overwrites the slot extra used
    np.testing.assert_array_equal(p.ids(r), list(range(10)) + list(range(100, 300)) + [50])
    assert p.propose(p.ids(r, [3]), 2) == [4, 5]


def test_ngram_propose_after_pending_guesses_the_pending_token():
    """Drafts for the positions after a token still in flight: the known tokens' longest suffix of
    lo - 1 .. hi - 1 tokens is looked up, the token after its latest occurrence is the guess for the
    pending one, and the drafts are what followed the guess there."""
    p = NgramProposer(k=3, lookup_min=2, lookup_max=3)
    # suffix [1, 2] last seen at 0: guess 3, drafts 4 9 1
    assert p.propose_after_pending([1, 2, 3, 4, 9, 1, 2], 3) == [4, 9, 1]
    assert p.propose_after_pending([1, 2, 3, 4, 9, 1, 2], 2) == [4, 9]      # the budget caps the drafts
    assert p.propose_after_pending([1, 2, 3, 4, 9, 1, 2], 0) == []
    # with the guess right, the drafts are the continuation propose finds once it is known
    assert p.propose([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert p.propose_after_pending([1, 2, 3, 4, 5], 3) == []                # no suffix recurs
    assert p.propose_after_pending([7, 1, 8, 1], 3) == [1]                  # guess 8, then the one known token
    assert p.propose_after_pending([7, 1, 8], 3) == []                      # the guess has nothing after it
    one = NgramProposer(k=2, lookup_min=1, lookup_max=1)                    # lo = hi = 1: a 1-token suffix still
    assert one.propose_after_pending([5, 6, 7, 5], 2) == [7, 5]


class _Req:  # what may_propose_after_pending reads (held weakly by the proposer)
    def __init__(self, toks):
        self.all_token_ids = list(toks)


@pytest.mark.parametrize("lo,hi", [(1, 3), (2, 4), (3, 3)])
def test_ngram_may_propose_after_pending_is_exact(lo, hi):
    """False exactly when no token x in flight could make `propose` return drafts; checked by brute
    force over a small vocabulary, growing each request token by token (the incremental index)."""
    V = 6
    rng = np.random.default_rng(lo * 10 + hi)
    p = NgramProposer(k=3, lookup_min=lo, lookup_max=hi)
    n_false = n_true = 0
    for _ in range(30):
        req = _Req(rng.integers(0, V, 1))
        for _ in range(12):
            want = any(p.propose(req.all_token_ids + [x], 3) for x in range(V))
            got = p.may_propose_after_pending(req)
            assert got == want, (req.all_token_ids, lo, hi)
            n_true += got
            n_false += not got
            req.all_token_ids.append(int(rng.integers(0, V)))
    assert n_true and (n_false or lo == 1)  # both answers exercised (lo = 1: any known token may recur)


def test_spec_stats():
    s = SpecStats(3)
    s.record(3, 3)
    s.record(2, 0)
    s.record(0, 0)  # a row without drafts is not a draft
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 5, 3)
    assert s.acceptance_rate == pytest.approx(0.6) and s.mean_accepted_length == pytest.approx(2.5)
    assert s.accepted_per_position == [1, 1, 1]
    with pytest.raises(ValueError, match="4 accepted of 2"):
        s.record(2, 4)


# ---------------------------------------------------------------------------- scheduler roll-back
def _sched(num_blocks=16, bs=4, caching=True):
    from jvllm.config import SchedulerConfig
    from jvllm.engine.scheduler import Scheduler
    from jvllm.memory.block_pool import KVCacheManager

    kv = KVCacheManager(num_blocks, bs, caching)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64), kv), kv


def _req(rid, prompt):
    from jvllm.engine.request import Request
    from jvllm.sampling_params import SamplingParams

    return Request(rid, prompt, SamplingParams(max_tokens=50, ignore_eos=True), seed=0)


def test_scheduler_gives_k_plus_one_tokens_and_rolls_back_rejected_drafts():
    sc, kv = _sched()
    sc.add(_req("a", list(range(10, 16))))  # 6 prompt tokens
    sc.update_after_step(sc.schedule())
    req = sc.running[0]
    req.append_token(99, None, None)  # 7 tokens, 6 computed
    req.spec_token_ids = [1, 2, 3, 4, 5]  # 5 drafts: positions 6..11 -> blocks 0..2
    out = sc.schedule()
    s = out.scheduled[0]
    assert (s.start, s.num_tokens, s.spec_token_ids, s.samples) == (6, 6, [1, 2, 3, 4, 5], True)
    assert len(kv.block_ids(req)) == 3
    sc.update_after_step(out)
    assert req.num_computed_tokens == 7  # drafts do not count until accepted
    for t in (1, 7):  # one draft accepted, then the target's token
        req.append_token(t, None, None)
    sc.accept_speculated(s, 1)
    assert req.num_computed_tokens == 8 and req.num_tokens == 9
    assert len(kv.block_ids(req)) == 2  # block 2 held only rejected drafts: given back
    # prefix-cache hashes only for blocks full of accepted tokens (2 full blocks of 8 computed)
    assert kv.num_cached["a"] == 2 and len(kv.pool.cached) == 2
    assert kv.pool.num_free == 16 - 1 - 2
    with pytest.raises(ValueError, match="3 drafts accepted of 2"):
        sc.accept_speculated(dataclass_replace(s, spec_token_ids=[1, 2]), 3)
    with pytest.raises(RuntimeError, match="must be appended first"):
        sc.accept_speculated(s, 2)  # 9 computed of 9 tokens: the target's token was not appended


def test_scheduler_moves_the_step_dispatched_ahead_of_a_verified_row():
    """A verified row whose next step went ahead of it (its entry `follow`, laid out as if no draft
    were accepted, with drafts of its own): reading the verify step moves that entry by the accepted
    count and keeps the blocks of all its tokens (drafts too), giving back only blocks past them."""
    sc, kv = _sched()
    sc.add(_req("a", list(range(10, 16))))
    sc.update_after_step(sc.schedule())
    req = sc.running[0]
    req.append_token(99, None, None)                 # 7 tokens, 6 computed
    req.spec_token_ids = [1, 2, 3, 4, 5]
    out = sc.schedule()
    s = out.scheduled[0]                             # positions 6..11
    sc.update_after_step(out)                        # as the engine does before dispatching ahead
    req.num_pending = 1
    assert kv.allocate_slots(req, 1 + 5 + 3)         # every draft of both steps accepted: up to 15
    assert len(kv.block_ids(req)) == 4
    req.spec_token_ids = [7, 8, 9]
    f = sc.schedule(allow_preempt=False).scheduled[0]
    assert (f.start, f.num_tokens, f.spec_token_ids) == (7, 4, [7, 8, 9])
    s.follow = f
    req.num_pending = 1                              # the verify step read: the ahead step's token remains
    for t in (1, 2, 5):                              # two drafts accepted, then the target's token
        req.append_token(t, None, None)
    sc.accept_speculated(s, 2)
    assert req.num_computed_tokens == 9 and f.start == 9  # f's tokens sit at 9..12
    assert len(kv.block_ids(req)) == 4               # block 3 holds f's positions 12: kept
    from jvllm.engine.scheduler import SchedulerOutput

    sc.update_after_step(SchedulerOutput([f], [], 4))
    assert req.num_computed_tokens == 10             # f's pending token, its drafts not yet accepted


def dataclass_replace(s, **kw):
    import dataclasses

    return dataclasses.replace(s, **kw)


def test_scheduler_drops_drafts_that_do_not_fit():
    sc, kv = _sched(num_blocks=3, bs=4)  # 2 usable blocks: 8 slots
    sc.add(_req("a", [1, 2, 3, 4, 5, 6]))
    out = sc.schedule()
    sc.update_after_step(out)
    req = sc.running[0]
    req.append_token(9, None, None)
    req.spec_token_ids = [1, 2, 3, 4]  # would need slots 6..10: 3 blocks
    out = sc.schedule()
    s = out.scheduled[0]
    assert (s.num_tokens, s.spec_token_ids) == (1, []) and sc.num_preemptions == 0  # a plain decode instead
    # the token budget cuts drafts too
    sc2, _ = _sched()
    sc2.cfg = dataclass_replace(sc2.cfg, max_num_batched_tokens=3, max_num_seqs=2)
    sc2.add(_req("b", [1, 2]))
    sc2.update_after_step(sc2.schedule())
    r2 = sc2.running[0]
    r2.append_token(5, None, None)
    r2.spec_token_ids = [7, 8, 9, 10]
    s = sc2.schedule().scheduled[0]
    assert (s.num_tokens, s.spec_token_ids, s.samples) == (3, [7, 8], True)


# ---------------------------------------------------------------------------- rejection sampler
def _chi2_p(counts, probs):
    from scipy.stats import chisquare

    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    exp = probs[keep] / probs[keep].sum() * counts.sum()
    return chisquare(counts[keep], exp).pvalue


def _run_verify(logits, draft, nd, temp, top_k, top_p, min_p, q=None, n=6000, seed0=0):
    import jax
    import jax.numpy as jnp

    from jvllm.spec_decode.rejection import verify
    from jvllm.worker.sampler import key_data

    R = n
    rep = lambda a: jnp.broadcast_to(jnp.asarray(a), (R,) + np.shape(a))  # noqa: E731
    keys = jnp.asarray(np.array([key_data(seed0 + i) for i in range(R)], np.uint32))
    fn = jax.jit(verify)
    tok, a = fn(rep(logits), rep(draft), rep(np.int32(nd)), rep(np.float32(temp)), rep(np.int32(top_k)),
                rep(np.float32(top_p)), rep(np.float32(min_p)), keys, jnp.zeros(R, jnp.int32),
                None if q is None else rep(q))
    return np.asarray(tok), np.asarray(a)


def _target_probs(logits, temp, top_k, top_p, min_p):
    import jax.numpy as jnp

    from jvllm.spec_decode.rejection import processed_probs

    K1, V = logits.shape
    f = lambda a, dt: jnp.full((K1,), a, dt)  # noqa: E731
    return np.asarray(processed_probs(jnp.asarray(logits), f(temp, jnp.float32), f(top_k, jnp.int32),
                                      f(top_p, jnp.float32), f(min_p, jnp.float32)), np.float64)


@pytest.mark.parametrize("case", ["ngram", "draft", "draft_top_k_p"])
def test_rejection_sampler_follows_the_target_distribution(case):
    """First emitted token ~ p_0, and the second (given the first draft was accepted) ~ p_1, with
    one-hot drafts (n-gram) and with a draft distribution q (draft model), over 6000 seeds."""
    rng = np.random.default_rng(1)
    V, k = 8, 3
    logits = rng.normal(0, 1.2, (k + 1, V)).astype(np.float32)
    temp, top_k, top_p, min_p = (0.8, 0, 1.0, 0.0) if case != "draft_top_k_p" else (1.0, 6, 0.85, 0.05)
    p = _target_probs(logits, temp, top_k, top_p, min_p)
    q = None
    if case == "ngram":
        draft = np.array([int(np.argsort(p[0])[-2]), 3, 5], np.int32)  # the second-likeliest token first
    else:
        q = rng.dirichlet(np.ones(V), size=k).astype(np.float32)
        # the first draft where q exceeds p, so that it is sometimes rejected
        draft = np.array([int(np.argmax(q[0] - p[0]))] + [int(rng.integers(V)) for _ in range(k - 1)], np.int32)
        assert q[0][draft[0]] > p[0][draft[0]]
    tok, a = _run_verify(logits, draft, k, temp, top_k, top_p, min_p, q)
    first = np.bincount(tok[:, 0], minlength=V)
    if case == "ngram":
        assert _chi2_p(first, p[0]) > 1e-3, (first, p[0])
        acc = a >= 1
        assert abs(acc.mean() - p[0][draft[0]]) < 4 * np.sqrt(p[0][draft[0]] * (1 - p[0][draft[0]]) / len(a))
        second = np.bincount(tok[acc, 1], minlength=V)
        assert _chi2_p(second, p[1]) > 1e-3, (second, p[1])
    else:
        # with drafts fixed (not drawn per seed from q), the emitted first token's law is
        # min(p, q) at the draft + (1 - sum) * resid: check it against that exact mixture
        pd, qd = p[0][draft[0]], q[0][draft[0]]
        acc_prob = min(1.0, pd / qd)
        resid = np.maximum(p[0] - q[0], 0)
        resid = resid / resid.sum()
        law = (1 - acc_prob) * resid
        law[draft[0]] += acc_prob
        assert _chi2_p(first, law) > 1e-3, (first, law)
    assert np.all(tok[np.arange(len(a)), a] >= 0) and np.all((a >= 0) & (a <= k))


def test_rejection_sampler_with_drafts_drawn_from_q_matches_p():
    """The full scheme: drafts drawn from q per seed (as a draft model does), then verified; the
    first emitted token must follow p exactly."""
    rng = np.random.default_rng(2)
    V, k, n = 6, 2, 6000
    logits = rng.normal(0, 1.0, (k + 1, V)).astype(np.float32)
    p = _target_probs(logits, 1.0, 0, 1.0, 0.0)
    q = rng.dirichlet(np.ones(V) * 0.7, size=k).astype(np.float32)
    q = q / q.sum(-1, keepdims=True)
    counts = np.zeros(V, np.int64)
    d0 = rng.choice(V, size=n, p=q[0].astype(np.float64) / q[0].sum())
    for t in range(V):  # one batch per first draft token (the rest of the draft is irrelevant to token 1)
        m = int((d0 == t).sum())
        if not m:
            continue
        draft = np.array([t, int(rng.integers(V))], np.int32)
        tok, _ = _run_verify(logits, draft, k, 1.0, 0, 1.0, 0.0, q, n=m, seed0=10_000 * (t + 1))
        counts += np.bincount(tok[:, 0], minlength=V)
    assert _chi2_p(counts, p[0]) > 1e-3, (counts, p[0])


def test_rejection_sampler_greedy_keeps_the_longest_matching_prefix():
    import jax.numpy as jnp

    from jvllm.spec_decode.rejection import verify_greedy

    rng = np.random.default_rng(3)
    V, k = 16, 4
    logits = rng.normal(0, 1, (k + 1, V)).astype(np.float32)
    best = logits.argmax(-1)
    for n_ok in range(k + 1):
        draft = best[:k].copy()
        if n_ok < k:
            draft[n_ok] = (draft[n_ok] + 1) % V
        tok, a = _run_verify(logits, draft.astype(np.int32), k, 0.0, 0, 1.0, 0.0, n=2)
        assert a[0] == n_ok
        assert list(tok[0, :n_ok + 1]) == list(best[:n_ok + 1])  # accepted drafts, then the correction / bonus
        g_tok, g_a = verify_greedy(jnp.asarray(logits)[None], jnp.asarray(draft, jnp.int32)[None],
                                   jnp.asarray([k], jnp.int32))  # the all-greedy variant agrees
        assert int(g_a[0]) == n_ok and list(np.asarray(g_tok)[0]) == list(tok[0])
    tok, a = _run_verify(logits, best[:k].astype(np.int32), 2, 0.0, 0, 1.0, 0.0, n=1)  # only 2 drafts valid
    assert a[0] == 2 and list(tok[0, :3]) == list(best[:3])


# ---------------------------------------------------------------------------- ids handed on the device
@pytest.mark.parametrize("query_tile, decode", [(4, False), (1, True), (1, False)])
def test_take_pending_moves_verified_rows_by_their_accepted_count(query_tile, decode):
    """A step laid out with each pending row at its no-draft-accepted position reads, from prev_tok,
    the ids and the accepted counts (`pending_ids.encode`): the positions and KV slots of every
    token of such a row (its drafts too) then equal the metadata of the batch laid out at the moved
    positions, across block boundaries; rows without a count (plain sampled ids, host tokens) keep
    theirs."""
    import jax.numpy as jnp

    from jvllm.ops.attention import build_metadata
    from jvllm.worker.pending_ids import encode, take_pending

    bs, T, R, W, nb = 4, 16, 4, 8, 64
    rng = np.random.default_rng(0)
    tables = rng.permutation(np.arange(1, nb))[:R * W].reshape(R, W).astype(np.int32)
    # rows: a prefill chunk of 5 host tokens (decode steps: one token each), then pending rows
    starts = np.array([3, 7, 12, 15]) if decode else np.array([0, 7, 12, 15])
    # mixed step: a prefill chunk of 5 host tokens, then row 1's pending token with 2 drafts after it
    ns = np.array([1, 1, 1, 1]) if decode else np.array([5, 3, 1, 1])
    accepted = np.array([0, 2, 3, 0])      # row 1: 7 -> 9 and row 2: 12 -> 15 change blocks
    NT = R if decode else R + -(-T // query_tile)
    kw = dict(T=T, query_tile=query_tile, num_tiles=NT, block_size=bs, num_blocks=nb)
    md = build_metadata(starts, ns, tables, **kw)
    want = build_metadata(starts + accepted, ns, tables, **kw)
    tokens = np.arange(T, dtype=np.int32) + 1000
    src = np.full(T, -1, np.int32)
    first = int(ns[0])
    at = first + np.concatenate([[0], np.cumsum(ns[1:])[:-1]])  # the first token of rows 1..3
    src[at] = [2, 0, 5]                    # rows 1..3 take their first id from prev rows 2, 0, 5
    prev = np.zeros(8, np.int32)
    prev[[2, 0, 5]] = [encode(np.int32(101), 2), encode(np.int32(202), 3), 303]  # row 3: a plain sampled id
    jmd = type(md)(*(jnp.asarray(getattr(md, f)) for f in md.__dataclass_fields__))
    ids, out = take_pending(jnp.asarray(prev), jnp.asarray(src), jnp.asarray(tokens), jmd, bs, True, decode)
    got = np.asarray(ids)
    assert list(got[at]) == [101, 202, 303]
    keep = src < 0
    np.testing.assert_array_equal(got[keep], tokens[keep])  # host tokens (drafts too) as they are
    np.testing.assert_array_equal(np.asarray(out.positions), want.positions)
    np.testing.assert_array_equal(np.asarray(out.slot_mapping), want.slot_mapping)
    assert want.slot_mapping[first] // bs != md.slot_mapping[first] // bs  # a moved row changed blocks
    # unshifted programs read the ids as they are
    ids0, out0 = take_pending(jnp.asarray(prev), jnp.asarray(src), jnp.asarray(tokens), jmd, bs, False)
    assert out0 is jmd and int(np.asarray(ids0)[at[2]]) == 303


def test_accepted_counts_are_read_only_where_they_fit():
    """n-gram on one stage with ids below 2^24: the step programs read the counts; a draft model,
    several stages or a larger vocabulary: they do not (the step after a verify step waits)."""
    from types import SimpleNamespace as NS

    from jvllm.worker.pending_ids import MAX_VOCAB
    from jvllm.worker.programs import takes_accepted_counts

    ctx = NS(spec=(4, False), stages=[0], cfg=NS(vocab_size=262_144))
    assert takes_accepted_counts(ctx)
    assert not takes_accepted_counts(NS(**(ctx.__dict__ | dict(spec=(4, True)))))
    assert not takes_accepted_counts(NS(**(ctx.__dict__ | dict(stages=[0, 1]))))
    assert not takes_accepted_counts(NS(**(ctx.__dict__ | dict(spec=None))))
    assert not takes_accepted_counts(NS(**(ctx.__dict__ | dict(cfg=NS(vocab_size=MAX_VOCAB + 1)))))
