"""The host side of sampling: the per-batch variant, the one packed per-row array and its unpacking,
and the exact-variant (GPU) sampler policy end to end against the branchy one."""
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jvllm import SamplingParams
from jvllm.sampling import SamplerImpl, SamplerVariant
from jvllm.worker.programs import sample_variants
from jvllm.worker.sampler import FLAG_LOGPROBS, FLAG_MASK, RowLayout, allow_bits, choose_variant, plan

V, L = 100, 16
GPU, CPU = SamplerImpl(4, False), SamplerImpl(1, True)


def _row(seed=1, prompt=(5, 6, 7), out=(), grammar=None, samples=True, **kw):
    p = SamplingParams(**kw)
    req = SimpleNamespace(params=p, seed=seed, num_output_tokens=len(out), num_pending=0, grammar=grammar,
                          all_token_ids=list(prompt) + list(out), num_prompt_tokens=len(prompt),
                          output_token_ids=list(out), eos_token_ids=(2,), bad_words_ids=None)
    return SimpleNamespace(req=req, samples=samples)


def test_plain_greedy_batches_need_no_inputs():
    assert plan([_row(temperature=0), _row(temperature=0)], 4, V, L, GPU) is None
    assert plan([_row(temperature=0, logprobs=1)], 4, V, L, GPU).variant == SamplerVariant(0, True)


@pytest.mark.parametrize("impl", [GPU, CPU], ids=["gpu", "cpu"])
def test_every_chosen_unmasked_variant_is_compiled_at_warm_up(impl):
    """Whatever mix of rows a batch holds, its variant is one the warm-up compiled (so serving
    compiles nothing), and it covers every row."""
    rng = np.random.default_rng(0)
    warm = set(sample_variants(impl))
    for _ in range(300):
        rows = [_row(temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.choice([0, 0, 5, 80, V + 5])),
                     top_p=float(rng.choice([1.0, 1.0, 0.9])), min_p=float(rng.choice([0.0, 0.1])),
                     logprobs=[None, None, 2][rng.integers(3)], repetition_penalty=float(rng.choice([1.0] * 5 + [1.2])),
                     min_tokens=int(rng.choice([0] * 5 + [2])))
                for _ in range(int(rng.integers(1, 5)))]
        v = choose_variant(rows, V, impl)
        assert v in warm, v
        ps = [r.req.params for r in rows if not r.req.params.greedy]
        need = 0
        for p in ps:
            need |= (2 if 0 < p.top_k < V else 0) | (1 if p.top_p < 1 else 0)
        assert v.search & need == need and (v.logprobs or not any(r.req.params.logprobs for r in rows))
        assert v.wide_top_k or not any(impl.narrow_top_k < p.top_k < V for p in ps)


def test_smallest_variants_on_gpu():
    assert choose_variant([_row(temperature=0.8)], V, GPU) == SamplerVariant(0, False)
    assert choose_variant([_row(temperature=0.8, top_p=0.9), _row(temperature=0.8, min_p=0.1)], V, GPU) == SamplerVariant(1, False)
    # any top_k row needs the threshold search, with top_p in the same row or another
    assert choose_variant([_row(temperature=0.8, top_p=0.9), _row(temperature=0.8, top_k=5)], V, GPU) \
        == SamplerVariant(3, False, wide_top_k=False)
    assert choose_variant([_row(temperature=0.8, top_k=5)], V, GPU) == SamplerVariant(2, False, wide_top_k=False)
    # a top_k past the group select's (GPU.narrow_top_k) takes the largest variant's radix search
    assert choose_variant([_row(temperature=0.8, top_k=GPU.narrow_top_k + 1)], V, GPU) == SamplerVariant(3, True)
    assert choose_variant([_row(temperature=0.8, top_k=GPU.narrow_top_k)], V, GPU) == SamplerVariant(2, False, wide_top_k=False)
    # greedy rows need no search, whatever their top_k / top_p; top_k >= V is off
    assert choose_variant([_row(temperature=0, top_p=0.5, top_k=3, logprobs=0), _row(temperature=1, top_k=V)], V, GPU) \
        == SamplerVariant(0, True)
    assert choose_variant([_row(temperature=0.8, presence_penalty=0.5)], V, GPU) == SamplerVariant(3, True, True, wide_top_k=False)
    assert choose_variant([_row(temperature=0.8, presence_penalty=0.5, top_k=GPU.narrow_top_k + 1)], V, GPU) \
        == SamplerVariant(3, True, True)
    assert choose_variant([_row(temperature=0.8, allowed_token_ids=[3])], V, GPU) == SamplerVariant(0, False, False, True)
    assert choose_variant([_row(temperature=0.8)], V, CPU) == SamplerVariant(3, True)


def test_rows_pack_and_unpack():
    """Every field survives the int32 packing (floats bit-exact); padding rows are greedy and
    untruncated; only the used prefix of bias and history is read."""
    rows = [_row(seed=2**64 - 3, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logprobs=1, out=(9, 9),
                 repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={4: 2.5, 8: -1.0}),
            _row(seed=7, temperature=1.2, min_tokens=3, allowed_token_ids=[1, 40, 99], out=(11,))]
    p = plan(rows, 4, V, L, GPU)
    assert p.variant == SamplerVariant(3, True, True, True, wide_top_k=False) and p.want_lp and p.rows.dtype == np.int32
    lay = RowLayout(4, V, L, p.variant)
    sb, ex, mask = lay.unpack(jnp.asarray(p.rows))
    np.testing.assert_array_equal(np.asarray(sb.temperature), np.float32([0.7, 1.2, 0, 0]))
    assert np.asarray(sb.top_k).tolist() == [5, V, V, V]
    np.testing.assert_array_equal(np.asarray(sb.top_p), np.float32([0.9, 1, 1, 1]))
    np.testing.assert_array_equal(np.asarray(sb.min_p), np.float32([0.05, 0, 0, 0]))
    assert np.asarray(sb.key_data)[:2].tolist() == [[2**32 - 1, 2**32 - 3], [0, 7]]
    assert np.asarray(sb.counter).tolist() == [2, 1, 0, 0] and bool(sb.want_logprobs)
    np.testing.assert_array_equal(np.asarray(ex.repetition), np.float32([1.3, 1, 1, 1]))
    np.testing.assert_array_equal(np.asarray(ex.frequency), np.float32([0.5, 0, 0, 0]))
    hist = np.asarray(ex.hist_ids)
    assert hist[0, :6].tolist() == [5, 6, 7, 9, 9, -1] and (hist[1:] == -1).all()  # row 1: min_tokens, no penalty
    assert np.asarray(ex.hist_is_out)[0, :6].tolist() == [False, False, False, True, True, False]
    b_ids, b_vals = np.asarray(ex.bias_ids), np.asarray(ex.bias_vals)
    assert b_ids[0, :3].tolist() == [4, 8, -1] and b_vals[0, :2].tolist() == [2.5, -1.0]
    assert b_ids[1, :2].tolist() == [2, -1] and b_vals[1, 0] == -np.inf  # min_tokens forbids EOS 2
    assert (b_ids[2:] == -1).all()
    assert np.asarray(mask.rows).tolist() == [False, True, False, False]
    assert not np.asarray(mask.before_logprobs).any()
    np.testing.assert_array_equal(np.asarray(mask.words)[1], allow_bits(rows[1].req, V).view(np.int32))
    assert p.rows[:, 7].tolist()[:2] == [FLAG_LOGPROBS, FLAG_MASK]


def test_a_grammar_and_allowed_ids_intersect():
    class G:
        def fill(self, row):
            row[0] = 0b1110  # tokens 1, 2, 3

    r = _row(temperature=0, grammar=G(), allowed_token_ids=[2, 3, 50])
    p = plan([r, _row(temperature=0, grammar=G(), samples=False)], 2, V, L, GPU)
    words = p.rows[:, RowLayout(2, V, L, p.variant).mask_at:]
    assert words[0, 0] == 0b1100 and not words[0, 1:].any()
    assert p.rows[1, 7] == 0  # a row that does not sample this step is not masked


def test_bad_layout_shape_is_named():
    lay = RowLayout(4, V, L, SamplerVariant(0, False))
    with pytest.raises(ValueError, match=r"sampler rows of shape \(4, 3\); SamplerVariant\(search=0\) at R=4 needs \(4, 10\)"):
        lay.unpack(jnp.zeros((4, 3), jnp.int32))


def test_exact_variants_end_to_end_match_the_branchy_sampler(ckpt_dir, monkeypatch):
    """An engine with the GPU policy (exact variants, no conds) draws the same tokens and logprobs
    as the CPU policy on a mixed workload. (Sampler warm-up is off here, to keep the test short:
    each engine compiles the variants it meets; the warm set is checked above.)"""
    from jvllm import LLM
    from jvllm.worker import model_runner, programs

    monkeypatch.setattr(programs, "sample_variants", lambda impl: [])
    rng = np.random.default_rng(4)
    prompts = [{"prompt_token_ids": rng.integers(3, 250, int(rng.integers(2, 30))).tolist()} for _ in range(12)]
    # greedy rows next to top_k rows and top_p rows, min_p, logprobs: one variant, (search 3, logprobs)
    params = [SamplingParams(max_tokens=6, ignore_eos=True, seed=i, temperature=[0.0, 0.8, 1.3][i % 3],
                             top_k=[0, 5][i % 2], top_p=[0.8, 1.0][i % 2], min_p=float(rng.choice([0.0, 0.05])),
                             logprobs=2) for i in range(12)]

    def run():
        llm = LLM(ckpt_dir("llama"), dtype="float32", max_model_len=64, max_num_batched_tokens=32, max_num_seqs=8,
                  token_buckets=(8, 32), use_tqdm_on_load=False)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [(o.outputs[0].token_ids, [sorted(e) for e in o.outputs[0].logprobs or []]) for o in outs]
        finally:
            llm.shutdown()

    branchy = run()
    monkeypatch.setattr(model_runner.SamplerImpl, "for_platform", staticmethod(lambda platform: GPU))
    assert run() == branchy
