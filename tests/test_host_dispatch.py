"""The step's host dispatch: the parameter pack (fewer argument arrays, the same values) and the
C++ fast path of every steady-state program call."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.worker.param_pack import ParamPack


def _leaves():
    k = jax.random.PRNGKey(0)
    return [jax.random.normal(jax.random.fold_in(k, 0), (8, 4), jnp.float32),   # matrix: as it is
            jnp.arange(4, dtype=jnp.float32),                                   # norm scales: packed
            jax.random.normal(jax.random.fold_in(k, 1), (4, 8), jnp.bfloat16),
            jnp.full((6,), 2.0, jnp.float32),
            jnp.full((3,), 1.5, jnp.bfloat16),                                  # alone in its dtype: as it is
            jnp.ones((5,), jnp.float32),
            jnp.ones((4,), jnp.float32)]                                        # a bias, not a norm: as it is


NAMES = ["q_proj", "input_layernorm.weight", "o_proj", "q_norm.weight", "k_norm.weight", "norm.weight", "o_bias"]


def test_pack_round_trip_is_exact():
    leaves = _leaves()
    pack = ParamPack.plan(leaves, NAMES)
    assert pack.big == (0, 2, 4, 6) and len(pack.groups) == 1 and pack.num_args == 5
    assert [i for i, _, _ in pack.groups[0].members] == [1, 3, 5] and pack.groups[0].size == 15
    args = pack.pack(leaves)
    assert len(args) == 5 and args[0] is leaves[0]
    back = pack.unpack(args)
    for a, b in zip(leaves, back):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # inside a program too (static slices of the flat argument)
    out = jax.jit(lambda xs: [x * 1 for x in pack.unpack(xs)])(args)
    for a, b in zip(leaves, out):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pack_takes_small_quantization_scales():
    """Per-channel scales of quantized projections (any rank, shaped as the output dims) are packed
    with the norms of their dtype; one over MAX_PACKED elements and a 2-D non-scale stay as they are."""
    from jvllm.worker.param_pack import MAX_PACKED

    leaves = [jnp.ones((4, 8), jnp.float32), jnp.full((2, 3), 0.5, jnp.float32), jnp.arange(4.0),
              jnp.ones((MAX_PACKED + 1,), jnp.float32), jnp.full((5,), 3.0, jnp.float32), jnp.ones((2, 2))]
    names = ["['q_proj']", "['q_proj_scale']", "['input_layernorm']", "['down_proj_scale']",
             "['gate_proj_scale']", "['rope_norm_table']"]
    pack = ParamPack.plan(leaves, names)
    assert pack.big == (0, 3, 5) and [i for i, _, _ in pack.groups[0].members] == [1, 2, 4]
    back = jax.jit(lambda xs: [x * 1 for x in pack.unpack(xs)])(pack.pack(leaves))
    for a, b in zip(leaves, back):
        assert a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pack_leaves_sharded_vectors_alone():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("tensor"))
    leaves = [jax.device_put(jnp.ones(4), rep), jax.device_put(jnp.ones(4), split),
              jax.device_put(jnp.zeros(2), rep), jax.device_put(jnp.ones(6), split)]
    pack = ParamPack.plan(leaves, ["a.norm", "b.norm", "c.norm", "d.norm"])
    assert pack.big == (1, 3) and [i for i, _, _ in pack.groups[0].members] == [0, 2]
    args = pack.pack(leaves)
    assert args[-1].sharding == rep


def test_pack_refuses_a_wrong_tree():
    leaves = _leaves()
    with pytest.raises(ValueError, match="6 names for 7 leaves"):
        ParamPack.plan(leaves, NAMES[:6])
    pack = ParamPack.plan(leaves, NAMES)
    with pytest.raises(ValueError, match="6 leaves, planned for 7"):
        pack.pack(leaves[:6])
    with pytest.raises(ValueError, match="3 arguments, expected 5"):
        pack.unpack(pack.pack(leaves)[:3])


@pytest.fixture(scope="module")
def tiny_llm():
    from jvllm import LLM

    llm = LLM("random:tiny", dtype="float32", max_model_len=256, max_num_seqs=4, token_buckets=(8, 16),
              use_tqdm_on_load=False)
    llm.llm_engine.wait_for_warmup()
    yield llm
    llm.shutdown()


def test_steady_state_calls_take_the_cpp_fast_path(tiny_llm, monkeypatch):
    """After warm-up a decode step's programs never run jax's Python call path (which flattens
    and checks every argument in Python: `Compiled.call`, also the C++ path's cache miss)."""
    from jax._src import stages

    from jvllm import SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # twice: the second run hits the prefix cache, which takes one more program (its first call
    # is jax's cache miss, through Python); a third run then meets only primed calls
    first = [tiny_llm.generate([{"prompt_token_ids": [3, 4, 5]}], sp, use_tqdm=False) for _ in range(2)][0]
    calls = []
    orig = stages.Compiled.call

    def counted(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    monkeypatch.setattr(stages.Compiled, "call", staticmethod(counted))
    again = tiny_llm.generate([{"prompt_token_ids": [3, 4, 5]}], sp, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert calls == [], f"{len(calls)} program calls went through jax's Python path"


def test_runner_passes_packed_params(tiny_llm):
    st = tiny_llm.llm_engine.runner.stages[0]
    n_norms = sum(1 for a in st.leaves if a.ndim == 1)  # the tiny llama has no biases: every vector is a norm
    assert n_norms >= 4 and st.pack.num_args == len(st.leaves) - n_norms + 1
    assert st.params() is st.params()  # packed once, not per step


def test_launch_probe_reports_the_argument_counts(tiny_llm):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "host_profile.py")
    spec = importlib.util.spec_from_file_location("host_profile", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.launch_probe(tiny_llm, calls=3)
    st = tiny_llm.llm_engine.runner.stages[0]
    assert res["num_param_leaves"] == len(st.leaves) and res["num_param_args"] == st.pack.num_args
    assert res["num_kv_arrays"] == 2 * tiny_llm.llm_engine.model_config.num_layers
    assert all(res[k] > 0 for k in ("step_call_ms", "trivial_same_args_ms", "trivial_unpacked_leaves_ms",
                                    "trivial_two_args_ms", "greedy_call_ms"))
