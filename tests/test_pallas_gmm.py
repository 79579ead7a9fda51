"""jvllm's Pallas grouped matmul (moe_backend="pallas", interpret mode on CPU) against
jax.lax.ragged_dot: empty groups, one crowded group, rows past the groups' sum, shapes smaller than a
tile, bfloat16; the MoE FFN and a tiny Qwen3-MoE engine equal with both backends."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.ops.pallas_grouped_matmul import grouped_matmul, tile_table

CASES = [
    (40, 32, 64, [10, 0, 25, 3]),     # empty group between others; 2 rows past the sum
    (16, 64, 32, [16, 0, 0]),         # every row in the first group, exactly one tile
    (7, 32, 32, [1, 1, 1, 1, 1]),     # fewer rows than a tile (lhs padded), one row per group
    (100, 32, 16, [30, 2, 17, 0, 1, 50]),  # several tiles in one group, tile straddling group ends
    (24, 48, 32, [0, 0, 0]),          # no rows in any group: all zeros
    (5, 32, 32, [0, 1, 0, 0, 2, 0, 0, 0, 1, 0, 1, 0]),  # fewer rows than groups (a decode step)
]


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("M,K,N,sizes", CASES)
def test_equals_ragged_dot(M, K, N, sizes, swap):
    """Both products (a tile as lhs @ rhs, and as (rhs^T lhs^T)^T: `swap`) equal ragged_dot."""
    rng = np.random.default_rng(M)
    G = len(sizes)
    lhs = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(G, K, N)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, bm=16, swap=swap))(lhs, rhs, gs)
    want = jax.lax.ragged_dot(lhs, rhs, gs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-5)
    assert np.all(np.asarray(got)[sum(sizes):] == 0)


def test_bfloat16_and_output_dtype():
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.normal(size=(33, 64)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(4, 64, 32)) * 0.1, jnp.bfloat16)
    gs = jnp.asarray([5, 20, 0, 8], jnp.int32)
    got = grouped_matmul(lhs, rhs, gs)
    assert got.dtype == jnp.bfloat16
    want = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=0.05, rtol=0.02)
    f32 = grouped_matmul(lhs, rhs, gs, preferred_element_type=jnp.float32)
    assert f32.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(f32), np.asarray(want), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("sizes,extra,bm", [
    ([30, 0, 17, 1, 52], 3, 16),
    ([0, 1, 0, 0, 2, 0, 0, 0, 1, 0, 1, 0] * 4, 0, 16),   # fewer rows than groups: the table's bound is rows
    ([17] * 6, 0, 16),                                   # every group one row past a tile: 2 tiles each
    ([1] * 9 + [0] * 23, 0, 64),                          # one token's top-9 of 32 experts, 64-row tiles
])
def test_tile_table_covers_each_group_once(sizes, extra, bm):
    sizes = np.array(sizes)
    rows = int(sizes.sum()) + extra
    M = max(rows, bm)  # the kernel pads lhs to a tile
    t = np.asarray(tile_table(jnp.asarray(sizes, jnp.int32), M, bm, rows=rows))
    assert t.shape == (-(-rows // bm) + min(len(sizes), rows), 4)
    covered = np.zeros(M, int)
    for g, first, end, window in t:
        assert 0 <= window <= M - bm and window <= first and end <= window + bm
        covered[first:end] += 1
        if end > first:
            lo = sizes[:g].sum()
            assert lo <= first and end <= lo + sizes[g]  # a tile never leaves its group
    assert covered[:sizes.sum()].tolist() == [1] * int(sizes.sum()) and not covered[sizes.sum():].any()
    assert sum(int(e > f) for _, f, e, _ in t) == sum(-(-s // bm) for s in sizes)  # empty groups: no tile


def test_decode_launch_by_rows_against_experts():
    """Few rows over many experts keep 64-column tiles (more programs per active tile); from one
    row per expert on, 128 columns and 8 warps (the H200 sweeps in benchmarks/README.md)."""
    from jvllm.ops.pallas_grouped_matmul import launch_defaults

    assert launch_defaults(8, 128) == (64, 64, 128, 4, 4, False)      # one token, top-8 of 128
    assert launch_defaults(2048, 128) == (64, 128, 128, 3, 8, False)  # 256 tokens: 16 rows per expert
    assert launch_defaults(8192, 128)[:2] == (64, 128)                # 64 rows per expert
    assert launch_defaults(16384, 128) == (128, 256, 64, 3, 8, False)  # 2,048 tokens: prefill


def test_tile_table_has_no_loop():
    """No while loop in the tile table's program: on GPUs XLA runs one by copying its predicate to
    the host each trip, so a MoE step (three tables a layer) would block its dispatch."""
    text = jax.jit(lambda s: tile_table(s, 4096, 64)).lower(jnp.ones((128,), jnp.int32)).as_text()
    assert "while" not in text


def test_precision_is_refused():
    x = jnp.ones((4, 32), jnp.float32)
    with pytest.raises(ValueError, match="precision=.*not supported"):
        grouped_matmul(x, jnp.ones((2, 32, 32), jnp.float32), jnp.asarray([2, 2], jnp.int32),
                       precision=jax.lax.Precision.HIGHEST)


def test_shapes_without_a_triton_block_fall_back():
    """K = 24 has no power-of-two block >= 16: ragged_dot computes it (same contract)."""
    rng = np.random.default_rng(2)
    lhs = jnp.asarray(rng.normal(size=(10, 24)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(2, 24, 32)), jnp.float32)
    gs = jnp.asarray([4, 5], jnp.int32)
    np.testing.assert_allclose(np.asarray(grouped_matmul(lhs, rhs, gs)),
                               np.asarray(jax.lax.ragged_dot(lhs, rhs, gs)), atol=1e-5)


def test_moe_ffn_pallas_equals_xla():
    from jvllm.ops.grouped_matmul import moe_ffn

    rng = np.random.default_rng(0)
    T, D, I, E, k = 13, 32, 16, 8, 3
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), jnp.int32)
    w = jnp.asarray(rng.random((T, k)), jnp.float32)
    ws = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((E, D, I), (E, D, I), (E, I, D))]
    valid = jnp.asarray(np.arange(T) % 4 != 0)
    a = jax.jit(lambda *z: moe_ffn(*z, backend="pallas"))(x, idx, w, *ws, valid)
    b = jax.jit(lambda *z: moe_ffn(*z, backend="xla"))(x, idx, w, *ws, valid)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


def test_qwen3_moe_engine_same_tokens_both_backends(ckpt_dir, monkeypatch):
    """Greedy tokens of both backends equal; the pallas engine's 4-token steps (16 pairs of top-4
    over 16 experts) take the decode path, its 32-token steps the sorted grouped matmuls."""
    from jvllm import LLM, SamplingParams
    from jvllm.ops import pallas_moe_decode

    traced = []
    real = pallas_moe_decode.expert_rows
    monkeypatch.setattr(pallas_moe_decode, "expert_rows", lambda x, *a, **kw: traced.append(x.shape[0]) or real(x, *a, **kw))
    path = ckpt_dir("qwen3_moe")
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9], list(range(3, 40)))]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = {}
    for backend in ("xla", "pallas"):
        llm = LLM(path, dtype="float32", moe_backend=backend, use_tqdm_on_load=False, max_num_seqs=2,
                  max_num_batched_tokens=32, token_buckets=(4, 32))
        try:
            out[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        finally:
            llm.shutdown()
    assert out["pallas"] == out["xla"]
    assert traced and set(traced) == {4}


@pytest.mark.parametrize("M,swap", [(8, None), (2048, None), (2048, True)])
def test_lowers_to_triton_for_cuda(M, swap):
    """The grouped matmul lowers through jax's Triton backend at Qwen3-30B-A3B's gate shape, the
    decode and the prefill launch and the swapped product (cuda platform, traced on this CPU):
    catches constructs Triton refuses."""
    args = [jax.ShapeDtypeStruct((M, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16),
            jax.ShapeDtypeStruct((128,), jnp.int32)]
    kw = dict(bm=32, swap=True) if swap else {}
    f = lambda a, b, s: grouped_matmul(a, b, s, interpret=False, **kw)  # noqa: E731
    assert "__gpu$xla.gpu.triton" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
