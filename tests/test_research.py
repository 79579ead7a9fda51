"""Research API: live weights (get_weights / update_weights) and scoring against a trainer's dense
forward (issue 23)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.compilation import compile_count
from jvllm.worker.weights import live_params
from tests.research_ref import sequence_logprobs

PROMPTS = [list(range(3, 20)), list(range(40, 47)), [5, 9, 200, 31, 17, 4, 4, 8, 100, 250]]


@pytest.fixture(scope="module")
def llm(ckpt_dir):
    llm = LLM(ckpt_dir("llama"), dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8,
              token_buckets=(8, 32), use_tqdm_on_load=False, background_compile=False)
    yield llm
    llm.shutdown()


def _greedy(llm, prompts=PROMPTS, n=6):
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_get_weights_are_the_live_arrays(llm):
    w = _flat(llm.get_weights())
    live = live_params(llm.llm_engine.runner)
    assert set(w) == set(live) and "layers.1.mlp.down_proj" in w
    assert all(w[k] is live[k] for k in w)


def test_update_weights_in_place_no_recompile_and_matches_fresh_engine(llm, ckpt_dir):
    base = _greedy(llm)
    orig = _flat(llm.get_weights())
    rng = np.random.default_rng(1)
    # device arrays with the engine's sharding and dtype: used as they are, no copy
    new = {k: jax.device_put(jnp.asarray(np.asarray(v) + 0.05 * rng.standard_normal(v.shape).astype(np.float32)),
                             v.sharding) for k, v in orig.items()}
    ptrs = {k: a.unsafe_buffer_pointer() for k, a in new.items()}
    c0 = compile_count()
    llm.update_weights(new)
    live = live_params(llm.llm_engine.runner)
    assert {k: a.unsafe_buffer_pointer() for k, a in live.items()} == ptrs
    assert llm.llm_engine.runner.head_w is live["embed" if llm.llm_engine.model_config.tie_word_embeddings else "lm_head"]
    changed = _greedy(llm)
    assert compile_count() == c0  # the step and sampler programs took the new arrays as they are
    assert changed != base
    # the same outputs as an engine whose weights were the new ones from the start (host numpy,
    # as a nested dict: copied and placed)
    llm.update_weights(orig)
    assert _greedy(llm) == base  # the prefix cache was invalidated: no stale KV reused
    llm.update_weights(_nest({k: np.asarray(v) for k, v in new.items()}))
    assert _greedy(llm) == changed
    assert compile_count() == c0
    llm.update_weights(orig)


def _nest(flat):
    from jvllm.worker.weights import nest

    return nest(flat)


def test_update_weights_from_hf_pairs_and_casts(llm, ckpt_dir):
    import safetensors.numpy
    import glob

    base = _greedy(llm)
    orig = _flat(llm.get_weights())
    (f,) = glob.glob(f"{ckpt_dir('llama')}/*.safetensors")
    hf = safetensors.numpy.load_file(f)
    scaled = [(k, (v * 1.5).astype(np.float16) if "mlp" in k else v) for k, v in hf.items()]  # dtypes cast
    llm.update_weights(iter(scaled))
    got = live_params(llm.llm_engine.runner)
    assert got["layers.0.mlp.down_proj"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got["layers.0.mlp.down_proj"]),
                               (hf["model.layers.0.mlp.down_proj.weight"] * 1.5).astype(np.float16).astype(np.float32).T)
    assert _greedy(llm) != base
    llm.update_weights(hf.items())
    assert _greedy(llm) == base
    llm.update_weights(orig)


def test_update_weights_bad_input_names_it_and_swaps_nothing(llm):
    before = live_params(llm.llm_engine.runner)
    w = {k: np.asarray(v) for k, v in before.items()}
    with pytest.raises(ValueError, match=r"layers\.9\.mlp\.up_proj"):
        llm.update_weights({**w, "layers.9.mlp.up_proj": w["layers.0.mlp.up_proj"]})
    with pytest.raises(ValueError, match=r"'norm.weight': shape \(3,\)"):
        llm.update_weights({"norm.weight": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="not_a_tensor"):
        llm.update_weights([("model.not_a_tensor.weight", np.ones(3))])
    with pytest.raises(ValueError, match="params pytree"):
        llm.update_weights(3)
    after = live_params(llm.llm_engine.runner)
    assert all(after[k] is before[k] for k in before)


def test_update_weights_with_requests_in_flight(llm):
    """Stepped engine: the step in flight finishes with the old weights (its outputs come back from
    update_weights), the request goes on with the new ones from the next step."""
    eng = llm.llm_engine
    orig = _flat(llm.get_weights())
    zero = {k: (np.zeros_like(np.asarray(v)) if k == "norm.weight" else np.asarray(v)) for k, v in orig.items()}
    # zero final norm: every logit is 0, so greedy picks token 0 from then on
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eng.add_request("inflight", {"prompt_token_ids": PROMPTS[0]}, sp)
    outs = []
    while not outs or not outs[-1].outputs[0].token_ids:
        outs += eng.step()
    n_before = len(outs[-1].outputs[0].token_ids)
    in_flight = eng.loop.in_flight()
    drained = eng.update_weights(zero)
    assert len(drained) == in_flight == 1  # async scheduling: the next step was dispatched already
    outs += drained
    while eng.has_unfinished_requests():
        outs += eng.step()
    final = [o for o in outs if o.finished][-1].outputs[0].token_ids
    ref = _greedy(llm, [PROMPTS[0]], 8)[0]  # still the zeroed weights here
    assert ref == [0] * 8
    llm.update_weights(orig)
    full = _greedy(llm, [PROMPTS[0]], 8)[0]
    k = len(drained[-1].outputs[0].token_ids) if drained else n_before  # outputs are cumulative
    assert final[:k] == full[:k] and final[k:] == [0] * (8 - k) and 0 < k < 8


def test_score_matches_dense_forward(llm):
    cfg = llm.llm_engine.model_config
    params = {k: np.asarray(v) for k, v in live_params(llm.llm_engine.runner).items()}
    conts = [[7, 8, 9, 10], list(range(100, 140)), [3]]
    got = llm.score(PROMPTS, conts)
    for p, c, g in zip(PROMPTS, conts, got):
        ref = sequence_logprobs(params, cfg, p, c)
        assert g.shape == (len(c),) and g.dtype == np.float32
        np.testing.assert_allclose(g, ref, atol=1e-5, rtol=0)
    one = llm.score(PROMPTS[0], conts[0])
    np.testing.assert_array_equal(one, got[0])
    with pytest.raises(ValueError, match="continuation 0 is empty"):
        llm.score(PROMPTS[0], [])


# ---------------------------------------------------------------------------- hidden states
def test_hidden_states_match_transformers(llm, ckpt_dir):
    import torch

    from tests.helpers import hf_model

    L = llm.llm_engine.model_config.num_layers
    layers = list(range(L + 1))
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, return_hidden_states=layers)
    plain = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    # a long prompt (chunked over steps) next to a request without hidden states, then a repeat
    # of the first prompt (a prefix-cache hit for a plain request, recomputed for this one)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0] * 3}, {"prompt_token_ids": PROMPTS[1]},
                         {"prompt_token_ids": PROMPTS[0] * 3}], [sp, plain, sp], use_tqdm=False)
    assert outs[1].outputs[0].hidden_states is None
    ref = hf_model(ckpt_dir("llama"))
    for o in (outs[0], outs[2]):
        c = o.outputs[0]
        ids = o.prompt_token_ids + c.token_ids[:-1]  # the last generated token is never fed
        with torch.no_grad():
            hf = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states
        assert sorted(c.hidden_states) == layers
        for i in layers:
            got, want = c.hidden_states[i], hf[i][0].numpy()
            assert got.shape == want.shape == (len(ids), llm.llm_engine.model_config.hidden_size)
            scale = np.abs(want).max(-1, keepdims=True)
            assert (np.abs(got - want) <= 1e-4 * scale).all(), i
    assert c.token_ids == _greedy(llm, [PROMPTS[0] * 3], 5)[0]


def test_hidden_states_bad_layers_named(llm):
    L = llm.llm_engine.model_config.num_layers
    with pytest.raises(ValueError, match=rf"return_hidden_states \[{L + 1}\] outside \[0, {L}\]"):
        llm.generate([PROMPTS[0]], SamplingParams(return_hidden_states=[0, L + 1]), use_tqdm=False)
    with pytest.raises(ValueError, match="distinct layer indices"):
        SamplingParams(return_hidden_states=[1, 1])


# ---------------------------------------------------------------------------- logits processors
def _ban_range(logits, output_ids, args):
    """Forbid token ids in [args[0], args[1]) and every id generated so far."""
    v = jnp.arange(logits.shape[-1])[None, :]
    banned = (v >= args[:, :1]) & (v < args[:, 1:2])
    seen = (output_ids[:, :, None] == v[:, None, :]).any(1)
    return jnp.where(banned | seen, -jnp.inf, logits)


def _force(logits, output_ids, args):
    """Put all mass on token args[0]."""
    v = jnp.arange(logits.shape[-1])[None, :]
    return jnp.where(v == args[:, :1].astype(jnp.int32), 0.0, -jnp.inf)


@pytest.fixture(scope="module")
def proc_llm(ckpt_dir):
    llm = LLM(ckpt_dir("llama"), dtype="float32", max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4,
              token_buckets=(8, 32), use_tqdm_on_load=False, background_compile=False,
              logits_processors={"ban": _ban_range, "force": _force})
    yield llm
    llm.shutdown()


def test_logits_processors_per_request(proc_llm):
    base = _greedy(proc_llm, PROMPTS[:2], 8)
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    c0 = None
    for hi, forced in ((200, 77), (150, 78)):  # new args are inputs: the second round compiles nothing
        ban = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logits_processors=["ban"],
                             extra_args={"ban": [0, hi]})
        force = SamplingParams(max_tokens=4, temperature=0.8, seed=3, ignore_eos=True, logits_processors=["force"],
                               extra_args={"force": forced}, logprobs=0)
        outs = proc_llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]},
                                  {"prompt_token_ids": PROMPTS[2]}], [ban, plain, force], use_tqdm=False)
        toks = [o.outputs[0].token_ids for o in outs]
        assert all(hi <= t for t in toks[0]) and len(set(toks[0])) == 8, toks[0]  # banned range and repeats
        assert toks[1] == base[1]  # the row without processors is untouched
        assert toks[2] == [forced] * 4
        assert all(abs(lp[forced].logprob) < 1e-6 for lp in outs[2].outputs[0].logprobs)
        if c0 is None:
            c0 = compile_count()
        assert compile_count() == c0


def test_logits_processors_bad_input_named(proc_llm, llm):
    with pytest.raises(ValueError, match=r"\['nope'\] are not registered"):
        proc_llm.generate([PROMPTS[0]], SamplingParams(logits_processors=["nope"]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"\['ban'\] are not registered"):
        llm.generate([PROMPTS[0]], SamplingParams(logits_processors=["ban"]), use_tqdm=False)
    with pytest.raises(ValueError, match="at most 8 numbers"):
        SamplingParams(logits_processors=["ban"], extra_args={"ban": list(range(9))})
    with pytest.raises(ValueError, match="naming one of this request's logits_processors"):
        SamplingParams(logits_processors=["ban"], extra_args={"force": 1})
    with pytest.raises(ValueError, match=r"logits_processors\['x'\] must be callable"):
        LLM("smollm2", logits_processors={"x": 3})


# ---------------------------------------------------------------------------- steering
def test_steering_per_request_no_recompile(llm):
    cfg = llm.llm_engine.model_config
    rng = np.random.default_rng(5)
    P = PROMPTS[0] * 2  # 34 tokens: chunked prefill, two full blocks for the prefix cache
    base = _greedy(llm, [P, PROMPTS[1]], 6)
    plain_h = llm.generate([{"prompt_token_ids": P}], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                                     return_hidden_states=[1]), use_tqdm=False)
    c0 = None
    for _ in range(2):  # a new vector is an input: the second round compiles nothing
        v = (rng.standard_normal(cfg.hidden_size) * 4).astype(np.float32)
        st = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, steering={1: v}, return_hidden_states=[1])
        plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": P}, {"prompt_token_ids": PROMPTS[1]}, {"prompt_token_ids": P}],
                            [st, plain, plain], use_tqdm=False)
        toks = [o.outputs[0].token_ids for o in outs]
        assert toks[0] != base[0]  # steered
        assert toks[1] == base[1] and toks[2] == base[0]  # other rows (and the same prompt unsteered) untouched
        got = outs[0].outputs[0].hidden_states[1][:len(P)]
        np.testing.assert_allclose(got, plain_h[0].outputs[0].hidden_states[1][:len(P)] + v, rtol=0, atol=1e-5)
        # the prefix cache: a plain request after the steered one reuses none of its blocks
        assert _greedy(llm, [P], 6)[0] == base[0]
        if c0 is None:
            c0 = compile_count()
        assert compile_count() == c0


def test_steering_bad_input_named(llm):
    L, D = llm.llm_engine.model_config.num_layers, llm.llm_engine.model_config.hidden_size
    with pytest.raises(ValueError, match=rf"steering layer {L} outside \[0, {L - 1}\]"):
        llm.generate([PROMPTS[0]], SamplingParams(steering={L: np.zeros(D)}), use_tqdm=False)
    with pytest.raises(ValueError, match=rf"steering\[0\] has shape \(3,\); the model's hidden size is {D}"):
        llm.generate([PROMPTS[0]], SamplingParams(steering={0: np.zeros(3)}), use_tqdm=False)
    with pytest.raises(ValueError, match="finite"):
        SamplingParams(steering={0: [np.nan]})


def test_research_figures_script_on_cpu(llm):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from research_figures import measure_update

    before = _greedy(llm)
    out = measure_update(llm, repeats=1)
    assert out["compiles"] == 0 and out["bytes"] > 0 and len(out["device_ms"]) == 1 and out["host_gb_s"][0] > 0
    assert _greedy(llm) == before  # the live weights are back


# ---------------------------------------------------------------------------- sleep mode
def test_sleep_and_wake_up(ckpt_dir, llm):
    s = LLM(ckpt_dir("llama"), dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8,
            token_buckets=(8, 32), use_tqdm_on_load=False, background_compile=False, enable_sleep_mode=True)
    base = _greedy(s)
    runner = s.llm_engine.runner
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in runner.kv)
    w_bytes = sum(a.nbytes for a in live_params(runner).values())
    assert s.sleep(level=1) == kv_bytes and runner.stages[0].kv is None
    with pytest.raises(RuntimeError, match="asleep"):
        _greedy(s)
    s.wake_up()
    assert _greedy(s) == base
    kv = runner.stages[0].kv[0][0]
    old = list(live_params(runner).values())
    assert s.sleep(level=2) == kv_bytes + w_bytes
    assert kv.is_deleted() and all(a.is_deleted() for a in old)
    s.wake_up()
    c0 = compile_count()
    assert _greedy(s) == base
    assert compile_count() == c0  # the step and sampler programs were kept
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from research_figures import measure_sleep

    fig = measure_sleep(s)
    assert fig["level2"]["freed_bytes"] == kv_bytes + w_bytes and fig["level1"]["wake_s"] > 0
    assert _greedy(s) == base
    s.shutdown()
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        llm.sleep()
    with pytest.raises(RuntimeError, match="not asleep"):
        llm.llm_engine.wake_up()


def test_update_weights_tensor_and_pipeline_parallel(ckpt_dir):
    """Names map onto each stage's own layers; resharded arrays land in the engine's shardings."""
    llm = LLM(ckpt_dir("llama"), dtype="float32", max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4,
              token_buckets=(16,), use_tqdm_on_load=False, background_compile=False,
              tensor_parallel_size=2, pipeline_parallel_size=2)
    base = _greedy(llm, PROMPTS[:2], 4)
    live = live_params(llm.llm_engine.runner)
    assert len(live) == len(_flat(llm.get_weights())) and "layers.1.mlp.up_proj" in live
    host = {k: np.asarray(v) for k, v in live.items()}
    shardings = {k: v.sharding for k, v in live.items()}
    llm.update_weights({k: v * 1.3 for k, v in host.items()})
    new = live_params(llm.llm_engine.runner)
    assert all(new[k].sharding == shardings[k] for k in new)
    changed = _greedy(llm, PROMPTS[:2], 4)
    assert changed != base
    llm.update_weights(host)
    assert _greedy(llm, PROMPTS[:2], 4) == base
    llm.shutdown()


def test_logits_processors_with_penalties(proc_llm):
    """A processor row next to a penalty row: the processors' sampler with its extras inputs."""
    ban = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logits_processors=["ban"],
                         extra_args={"ban": [0, 200]}, repetition_penalty=1.3)
    outs = proc_llm.generate([{"prompt_token_ids": PROMPTS[0]}], [ban], use_tqdm=False)
    toks = outs[0].outputs[0].token_ids
    assert len(toks) == 4 and all(t >= 200 for t in toks), outs[0].outputs[0].finish_reason
