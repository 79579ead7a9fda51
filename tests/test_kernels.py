"""Pallas kernels against the XLA reference (`paged_attention`), in interpret mode on the CPU.
The same comparisons run compiled on a GPU in benchmarks/gpu_kernels.py (device tool)."""
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.ops.attention import example_metadata, paged_attention, pallas_decode_attention
from jvllm.ops.pallas_attention import ragged_paged_attention

CASES = [
    # H, KH, D, block, Qt, window, spans (start, n)
    (8, 2, 32, 4, 8, None, [(0, 13), (5, 1), (20, 7), (0, 1)]),        # mixed: prefill, decode, continuation
    (9, 3, 16, 4, 8, None, [(3, 17), (40, 1)]),                       # SmolLM2-like G=3 (rows padded to 32)
    (4, 4, 16, 8, 4, 6, [(0, 30), (17, 1), (9, 5)]),                  # sliding window, MHA
    (8, 1, 16, 4, 16, None, [(0, 40)]),                               # MQA, one long prefill, several chunks
    (8, 2, 32, 4, 1, None, [(0, 1), (7, 1), (33, 1), (60, 1)]),       # decode-only tiles (Qt=1)
    (9, 3, 16, 4, 1, None, [(5, 1), (44, 1)]),                        # decode, G=3: XLA merges split-K
    (4, 4, 16, 4, 1, 6, [(0, 1), (30, 1), (17, 1)]),                  # decode, MHA (G=1), sliding window
]


def _inputs(H, KH, D, bs, Qt, spans, T=48, R=8, W=16, NB=80, seed=0):
    rng = np.random.default_rng(seed)
    md = example_metadata(spans, T=T, R=R, query_tile=Qt, block_size=bs, table_width=W, num_blocks=NB, seed=seed)
    q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
    kp = jnp.asarray(rng.standard_normal((KH, NB, bs, D)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((KH, NB, bs, D)), jnp.float32)
    return md, q, kp, vp


def _check_ragged(case, **kernel_kw):
    """The ragged kernel (interpret mode, `kernel_kw` launch options) against the reference on
    a CASES entry; returns (out, valid rows)."""
    H, KH, D, bs, Qt, window, spans = case
    md, q, kp, vp = _inputs(H, KH, D, bs, Qt, spans)
    ref = paged_attention(q, kp, vp, md, scale=D ** -0.5, window=window, kv_chunk_blocks=4)
    out = ragged_paged_attention(q, kp, vp, md, scale=D ** -0.5, window=window, interpret=True, **kernel_kw)
    valid = np.asarray(md.positions) >= 0
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(ref)[valid], atol=2e-5, rtol=2e-5)
    return np.asarray(out), valid


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_ragged_kernel_matches_reference(case):
    out, valid = _check_ragged(case, pages_per_block=2)
    assert not out[~valid].any(), "padding tokens must come back as zeros"


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4], CASES[5], CASES[6]],
                         ids=["mixed", "window", "decode", "decode_g3", "decode_mha_window"])
@pytest.mark.parametrize("splits", [3, "auto"])
def test_ragged_kernel_split_k_matches_reference(case, splits):
    """Split-K (flash-decoding): each tile's keys over several programs, partial states merged."""
    _check_ragged(case, pages_per_block=1, num_splits=splits)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]], ids=["mixed", "window", "multi_chunk"])
def test_ragged_kernel_prefetched_page_ids_match_reference(case):
    """`prefetch_ids`: page ids of chunk c+1 loaded during chunk c (clamped at the table's end)."""
    _check_ragged(case, pages_per_block=2, prefetch_ids=True)


def test_decode_splits_policy():
    from jvllm.ops.pallas_attention import decode_splits

    assert decode_splits(8, 8) == 16      # batch 1 (request bucket 8): 8 x 8 x 16 = 1024 programs
    assert decode_splits(256, 8) == 1     # batch 256: 2048 programs unsplit
    assert decode_splits(64, 8) == 4      # 64 x 8 x 4 = 2048


def test_launch_defaults_by_grid():
    """Narrow decode grids are split-K (B1 measured +6% on an H200), wide ones take 128 keys and
    one stage unsplit, multi-query tiles keep 64 keys, 2 stages, no split."""
    from jvllm.ops.pallas_attention import launch_defaults

    assert launch_defaults(16, 8, 1, 16) == (4, 2, 16)      # B1 in the 16-token bucket: 128 -> 2048 programs
    assert launch_defaults(64, 8, 1, 16) == (8, 1, 1)       # 512 programs: the wide decode launch
    assert launch_defaults(32, 4, 1, 16) == (4, 2, 16)      # TP=2's 4 local KV heads, 32 requests
    assert launch_defaults(128, 8, 16, 16) == (4, 2, 1)     # prefill / mixed tiles
    assert launch_defaults(16, 8, 1, 64) == (1, 2, 16)      # 64-token pages


def test_ragged_kernel_narrow_decode_defaults_match_reference():
    """Default arguments on a small decode batch: the split-K launch, against the reference."""
    _check_ragged(CASES[4])


def test_ragged_kernel_bf16():
    md, q, kp, vp = _inputs(8, 2, 32, 4, 8, [(0, 20), (11, 1), (30, 9)])
    q, kp, vp = (a.astype(jnp.bfloat16) for a in (q, kp, vp))
    ref = paged_attention(q, kp, vp, md, scale=32 ** -0.5, kv_chunk_blocks=4).astype(jnp.float32)
    out = ragged_paged_attention(q, kp, vp, md, scale=32 ** -0.5, interpret=True).astype(jnp.float32)
    valid = np.asarray(md.positions) >= 0
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(ref)[valid], atol=3e-2)


def test_decode_kernel_matches_reference():
    spans = [(0, 1), (9, 1), (40, 1), (63, 1)]
    md, q, kp, vp = _inputs(8, 2, 32, 4, 1, spans, T=8, R=8)
    ref = paged_attention(q, kp, vp, md, scale=32 ** -0.5, kv_chunk_blocks=4)
    out = pallas_decode_attention(q, kp, vp, md, scale=32 ** -0.5, interpret=True)
    np.testing.assert_allclose(np.asarray(out)[:4], np.asarray(ref)[:4], atol=2e-5, rtol=2e-5)


def test_ragged_kernel_wide_decode_defaults_match_reference():
    """A decode batch of >= 512 programs (128 requests x 4 KV heads) takes the wide decode launch
    (128 keys per inner step, clamped to the table width) with default arguments."""
    rng = np.random.default_rng(5)
    spans = [(int(s), 1) for s in rng.integers(0, 60, 128)]
    md, q, kp, vp = _inputs(8, 4, 16, 4, 1, spans, T=128, R=128, W=16, NB=128 * 16 + 8)
    ref = paged_attention(q, kp, vp, md, scale=16 ** -0.5, kv_chunk_blocks=4)
    out = ragged_paged_attention(q, kp, vp, md, scale=16 ** -0.5, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_one_query_tiles_are_tokens():
    """The ragged kernel reads q and writes o without gathers for one-query tiles because
    build_metadata puts token n in tile n (requests of several tokens included); padding tiles
    point at T."""
    from jvllm.ops.attention import build_metadata

    rng = np.random.default_rng(3)
    ns = rng.integers(1, 5, 6)
    tables = np.arange(6 * 8, dtype=np.int32).reshape(6, 8)
    T = int(ns.sum()) + 3
    md = build_metadata(rng.integers(0, 20, 6), ns, tables, T=T, query_tile=1, num_tiles=T + 2, block_size=4,
                        num_blocks=64)
    idx = np.asarray(md.tile_token_idx)[:, 0]
    n = int(ns.sum())
    assert (idx[:n] == np.arange(n)).all() and (idx[n:] == T).all()


@pytest.mark.parametrize("T,R", [(8, 8), (16, 4), (4, 12)])
def test_split_merge_kernel_for_one_query_tiles(T, R):
    """Small decode batches merge split-K partials in one Pallas program per (tile, KV head) when
    S, G and D are powers of two (else XLA merges them); the output rows are the tokens, whether
    there are fewer tiles than tokens or more."""
    import jax

    spans = [(0, 1), (9, 1), (40, 1), (63, 1)][:min(T, R)]
    md, q, kp, vp = _inputs(8, 2, 32, 4, 1, spans, T=T, R=R)
    md = type(md)(**{**md.__dict__, "tile_token_idx": md.tile_token_idx[:R], "tile_req": md.tile_req[:R]})
    f = lambda q, kp, vp: ragged_paged_attention(q, kp, vp, md, scale=32 ** -0.5, num_splits=4, interpret=True)  # noqa: E731
    assert "jvllm_split_merge_S4_G4" in str(jax.make_jaxpr(f)(q, kp, vp))
    out = np.asarray(f(q, kp, vp))
    ref = np.asarray(paged_attention(q, kp, vp, md, scale=32 ** -0.5, kv_chunk_blocks=4))
    valid = np.asarray(md.positions) >= 0
    assert out.shape == ref.shape == (T, 8, 32)
    np.testing.assert_allclose(out[valid], ref[valid], atol=2e-5, rtol=2e-5)
    assert not out[~valid].any()


# Gemma shapes: head_dim 256, G=2 (Gemma 3 270M: 4 heads, 1 KV head -> G=4), soft-capped scores
GEMMA_CASES = [
    # H, KH, D, block, Qt, window, spans, softcap
    (4, 2, 256, 4, 8, None, [(0, 13), (5, 1), (20, 7)], 0.5),          # mixed, global layer, soft-cap
    (4, 1, 256, 4, 8, 6, [(0, 30), (17, 1)], None),                    # sliding layer, G=4
    (4, 1, 256, 4, 1, 6, [(0, 1), (30, 1), (17, 1)], 0.5),             # decode, window + soft-cap
]


@pytest.mark.parametrize("case", GEMMA_CASES, ids=["mixed_cap", "window_g4", "decode_window_cap"])
@pytest.mark.parametrize("splits", [None, 2])
def test_ragged_kernel_head_dim_256_softcap(case, splits):
    """head_dim 256 and attention-logit soft-capping: the ragged kernel (split-K too) equals the
    reference; the soft-cap changes the result (it bites at these scores)."""
    H, KH, D, bs, Qt, window, spans, cap = case
    md, q, kp, vp = _inputs(H, KH, D, bs, Qt, spans)
    ref = paged_attention(q, kp, vp, md, scale=D ** -0.5, window=window, softcap=cap, kv_chunk_blocks=4)
    out = ragged_paged_attention(q, kp, vp, md, scale=D ** -0.5, window=window, softcap=cap, interpret=True,
                                 pages_per_block=2, num_splits=splits)
    valid = np.asarray(md.positions) >= 0
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(ref)[valid], atol=2e-5, rtol=2e-5)
    if cap is not None:
        uncapped = paged_attention(q, kp, vp, md, scale=D ** -0.5, window=window, kv_chunk_blocks=4)
        assert np.abs(np.asarray(uncapped) - np.asarray(ref))[valid].max() > 1e-2


def test_pallas_decode_kernel_head_dim_256():
    """JAX's Pallas decode kernel (global layers without soft-cap take it) at head_dim 256."""
    md, q, kp, vp = _inputs(4, 1, 256, 4, 1, [(0, 1), (30, 1), (17, 1)])
    ref = paged_attention(q, kp, vp, md, scale=256 ** -0.5, kv_chunk_blocks=4)
    out = pallas_decode_attention(q, kp, vp, md, scale=256 ** -0.5, interpret=True)
    np.testing.assert_allclose(np.asarray(out)[:3], np.asarray(ref)[:3], atol=2e-5, rtol=2e-5)


def test_token_rows_equal_gathered_tiles():
    """Tiles of several queries read q and write the output in token rows (`token_rows`, the
    default where Qt * G is a power of two >= 16): bit-equal to the gathered tile layout, a tile at
    the batch's end included (its Qt-row window shifted to stay inside T), the step's padding
    tokens zero; the program names the path it took. (fp8 pages on this path: test_kv_fp8.py.)"""
    import jax

    H, KH, D, bs, Qt = 8, 2, 32, 4, 8
    spans = [(0, 13), (3, 35)]  # 48 = T tokens: the last tile holds tokens 45..47, window 40..47
    md, q, kp, vp = _inputs(H, KH, D, bs, Qt, spans)
    ref = paged_attention(q, kp, vp, md, scale=D ** -0.5, kv_chunk_blocks=4)
    f = lambda rows: (lambda q, kp, vp: ragged_paged_attention(  # noqa: E731
        q, kp, vp, md, scale=D ** -0.5, pages_per_block=2, token_rows=rows, interpret=True))
    assert "ragged_paged_attention_rows" in str(jax.make_jaxpr(f(True))(q, kp, vp))
    assert "ragged_paged_attention_rows" not in str(jax.make_jaxpr(f(False))(q, kp, vp))
    rows, tiles = np.asarray(jax.jit(f(True))(q, kp, vp)), np.asarray(jax.jit(f(False))(q, kp, vp))
    np.testing.assert_array_equal(rows, tiles)
    np.testing.assert_allclose(rows, np.asarray(ref), atol=2e-5, rtol=2e-5)
    md2, q2, kp2, vp2 = _inputs(H, KH, D, bs, Qt, [(0, 13), (5, 1)])  # 14 of 48 tokens: padding after
    out = np.asarray(ragged_paged_attention(q2, kp2, vp2, md2, scale=D ** -0.5, pages_per_block=2, interpret=True))
    assert not out[14:].any() and out[:14].any()


@pytest.mark.parametrize("rows", [True, False])
def test_ragged_kernel_lowers_to_triton_for_cuda(rows):
    """Both mixed-tile paths lower through jax's Triton backend (cuda platform, traced on this
    CPU) at Llama-3-8B's heads in bfloat16: 256 tokens in 16-query tiles, fp8 pages too."""
    import jax

    from jvllm.ops.kv_quant import FP8, SCALE_DTYPE, QuantizedPages

    md = example_metadata([(i % 32, 1) for i in range(256)], T=256, R=256, query_tile=16, block_size=16,
                          table_width=16, num_blocks=600)
    q = jax.ShapeDtypeStruct((256, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((8, 600, 16, 128), jnp.bfloat16)
    f = lambda q, kp, vp: ragged_paged_attention(q, kp, vp, md, scale=0.088, token_rows=rows)  # noqa: E731
    text = jax.jit(f).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and ("ragged_paged_attention_rows" in text) == rows
    fp8 = QuantizedPages(jax.ShapeDtypeStruct((8, 600, 16, 128), FP8), jax.ShapeDtypeStruct((8, 600, 16), SCALE_DTYPE))
    assert "__gpu$xla.gpu.triton" in jax.jit(f).trace(q, fp8, fp8).lower(lowering_platforms=("cuda",)).as_text()


def test_token_rows_probe_dry_run(tmp_path):
    """benchmarks/probes/attention_token_rows.py runs (tiny shapes, interpret mode) and finds both
    paths bit-equal."""
    import json
    import os
    import subprocess
    import sys

    probe = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes", "attention_token_rows.py")
    out = tmp_path / "rows.json"
    p = subprocess.run([sys.executable, probe, "--tiny", "--layers", "1", "--iters", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all(r["bit_equal_to_gathered"] and r["ms"] > 0 for r in rows)
