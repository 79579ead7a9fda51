"""The fixed-tile matmul of batch-invariant mode (jvllm.ops.fixed_tile_matmul), interpret mode on
CPU: close to a float64 product, and every row bit-equal whatever the number of rows and the row's
place among them (where XLA's dot is not), with and without split-K, for one weight and for a
group of weights in one launch, and the split and walk launches bit-equal."""
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.ops.fixed_tile_matmul import (MIN_SPLIT_STEPS, ROW_TILE, TARGET_PROGRAMS, WALK_LAUNCHES,
                                         Launch, Tiles, fixed_tile_matmul, fixed_tile_matmuls, launch_shape,
                                         launch_splits, tiles)

RNG = np.random.default_rng(0)
ROWS = 100
SLICES = [(1, 77), (3, 5), (8, 3), (40, 60)]  # (rows, first row) of ROWS
F32, BF16 = jnp.float32, jnp.bfloat16

# (K, N, transposed, S, dtype): S = 1 and S > 1, each with an exact and a shifted last column tile
# (N = 40, 200), plain and transposed, float32 and bfloat16 (one dtype a shape: interpret mode
# compiles once per row count)
SHAPES = [(64, 256, False, 1, F32), (576, 1536, False, 1, BF16), (64, 40, False, 1, BF16), (96, 256, True, 1, F32),
          (2048, 256, False, 4, BF16), (2048, 200, False, 4, F32), (1024, 40, True, 2, BF16), (1024, 512, True, 2, F32)]


@pytest.mark.parametrize("K,N,transposed,S,dtype", SHAPES)
def test_rows_bit_equal_whatever_the_batch(K, N, transposed, S, dtype):
    assert tiles(K, N).splits == S
    x = jnp.asarray(RNG.standard_normal((ROWS, K)), dtype)
    w = jnp.asarray(RNG.standard_normal((N, K) if transposed else (K, N)) * 0.1, dtype)
    f = functools.partial(fixed_tile_matmul, w_transposed=transposed, out_dtype=jnp.float32)
    full = np.asarray(f(x, w))
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    ref = np.asarray(x.astype(jnp.float32), np.float64) @ (w64.T if transposed else w64)
    np.testing.assert_allclose(full, ref, rtol=1e-5, atol=1e-4)
    for m, off in SLICES:
        got = np.asarray(f(x[off:off + m], w))
        assert np.array_equal(got, full[off:off + m]), (m, off)


# (K, [N_i], S): q/k/v-like with a shifted tile in one member, gate/up-like
GROUPS = [(1024, (256, 64, 40), 2), (2048, (128, 128), 4)]


@pytest.mark.parametrize("K,Ns,S", GROUPS)
def test_group_rows_bit_equal_whatever_the_batch(K, Ns, S):
    assert tiles(K, *Ns).splits == S
    x = jnp.asarray(RNG.standard_normal((ROWS, K)), BF16)
    ws = [jnp.asarray(RNG.standard_normal((K, N)) * 0.1, BF16) for N in Ns]
    f = functools.partial(fixed_tile_matmuls, out_dtype=F32)
    full = [np.asarray(y) for y in f(x, ws)]
    x64 = np.asarray(x.astype(F32), np.float64)
    for y, w in zip(full, ws):
        np.testing.assert_allclose(y, x64 @ np.asarray(w.astype(F32), np.float64), rtol=1e-5, atol=1e-4)
    for m, off in SLICES:
        for got, want in zip(f(x[off:off + m], ws), full):
            assert np.array_equal(np.asarray(got), want[off:off + m]), (m, off)


@pytest.mark.parametrize("K,Ns,transposed", [(2048, (200,), False), (1024, (40,), True), (1024, (256, 64, 40), False)])
def test_split_and_walk_launches_bit_equal(K, Ns, transposed):
    """The walk launch (each program adds its K ranges' sums in registers) computes the split
    launch's float operations (partials stored, added in Python), so prefill-sized and
    decode-sized steps agree bit for bit; bf16 outputs too (one rounding of the same sum)."""
    assert tiles(K, *Ns).splits > 1
    x = jnp.asarray(RNG.standard_normal((37, K)), BF16)
    ws = [jnp.asarray(RNG.standard_normal((N, K) if transposed else (K, N)) * 0.1, BF16) for N in Ns]
    for dtype in (F32, BF16):
        f = functools.partial(fixed_tile_matmuls, x, ws, w_transposed=transposed, out_dtype=dtype)
        for a, b in zip(f(launch="split"), f(launch="walk")):
            assert np.array_equal(np.asarray(a.astype(F32)), np.asarray(b.astype(F32)))
    with pytest.raises(ValueError, match="launch='tiled'"):
        fixed_tile_matmuls(x, ws, w_transposed=transposed, launch="tiled")


def test_launch_splits_from_the_number_of_programs():
    t = tiles(4096, 4096)  # 32 column tiles, S = 8
    assert [launch_splits(t, M, 32) for M in (1, 32, 224, 225, 256, 2048)] == [8, 8, 8, 1, 1, 1]
    assert launch_splits(tiles(4096, 128256), 1, 1002) == 1  # S = 1 either way


def test_launch_shape_keeps_one_wave():
    """A walk launch takes the first WALK_LAUNCHES shape that still gives WALK_MIN_PROGRAMS
    programs, and only where M spans more than one ROW_TILE; a split launch keeps the tiles'."""
    t = tiles(4096, 4096)  # o: 32 column tiles of 128
    big, small = Launch(128, 128, 8, 4), Launch(64, 128)
    with mock.patch("jvllm.ops.fixed_tile_matmul.WALK_LAUNCHES", (big, small)), \
         mock.patch("jvllm.ops.fixed_tile_matmul.WALK_MIN_PROGRAMS", 128):
        # 128 programs: from 385 rows in 128-row tiles (4 x 32), from 193 in 64-row tiles
        assert [launch_shape(t, [4096], M, 1) for M in (32, 192, 193, 384, 385, 2048)] == \
            [Launch(ROW_TILE, 128), Launch(ROW_TILE, 128), small, small, big, big]
        assert launch_shape(t, [4096], 2048, 8) == Launch(ROW_TILE, 128)  # a split launch
    lm = tiles(4096, 128256)
    assert [launch_shape(lm, [128256], M, 1).bm for M in (8, 32)] == [ROW_TILE, ROW_TILE]
    assert launch_shape(lm, [128256], 33, 1) == WALK_LAUNCHES[0]  # 1002 column tiles: the first shape
    # the column cap picks a power-of-two tile of every weight, and S does not follow it
    with mock.patch("jvllm.ops.fixed_tile_matmul.WALK_LAUNCHES", (Launch(64, 256, 8, 3),)):
        assert launch_shape(tiles(4096, 4096, 1024, 1024), [4096, 1024, 1024], 2048, 1) == Launch(64, 256, 8, 3)
        assert launch_shape(tiles(64, 96), [96], 2048, 1).bn == 32
        assert tiles(4096, 4096).splits == t.splits


def test_walk_shape_fits_the_devices_shared_memory():
    """A GPU whose blocks hold about 99 KB of shared memory (Ampere / Ada consumer parts) skips the
    128 KB 128 x 128, 4-stage shape and takes the next; Hopper keeps it."""
    from jvllm.ops import fixed_tile_matmul as ftm

    t = tiles(4096, 14336, 14336)
    big = ftm._smem_bytes(128, 128, t.bk, 4)
    assert big == 128 * 1024 and ftm._smem_bytes(64, 128, t.bk, 3) <= 99 * 1024
    for limit, bm in ((99 * 1024, 64), (227 * 1024, 128)):
        with mock.patch.object(ftm, "WALK_LAUNCHES", (Launch(128, 128, 8, 4), Launch(64, 128))), \
             mock.patch.object(ftm, "_smem_limit", lambda limit=limit: limit):
            assert launch_shape(t, [14336, 14336], 2048, 1).bm == bm
    with mock.patch.object(ftm, "_smem_limit", lambda: 227 * 1024):  # float32 blocks take twice the bytes
        assert launch_shape(t, [14336, 14336], 2048, 1, (4, 4)) == Launch(64, 128)

    class Dev:  # what jax reports for a CUDA device
        platform, compute_capability = "gpu", "8.9"
    ftm._smem_limit.cache_clear()
    try:
        with mock.patch.object(ftm.jax, "devices", lambda: [Dev()]):
            assert ftm._smem_limit() == 99 * 1024
            ftm._smem_limit.cache_clear()
            Dev.compute_capability = "9.0"
            assert ftm._smem_limit() == 227 * 1024
    finally:
        ftm._smem_limit.cache_clear()


def test_walk_shapes_keep_the_bits():
    """Every walk shape (rows, column cap, warps, stages) computes the same bits as the split
    launch: the shape picks the program, not the order of an element's sum."""
    x = jnp.asarray(RNG.standard_normal((70, 1024)), jnp.bfloat16)
    ws = [jnp.asarray(RNG.standard_normal((1024, n)) * 0.05, jnp.bfloat16) for n in (96, 48)]
    ref = fixed_tile_matmuls(x, ws, launch="split", out_dtype=F32)
    for shape in (Launch(64, 128), Launch(16, 64, 8, 4), Launch(32, 16)):
        with mock.patch("jvllm.ops.fixed_tile_matmul.WALK_LAUNCHES", (shape,)), \
             mock.patch("jvllm.ops.fixed_tile_matmul.WALK_MIN_PROGRAMS", 1):
            got = fixed_tile_matmuls(x, ws, launch="walk", out_dtype=F32)
        for g, r in zip(got, ref):
            assert np.array_equal(np.asarray(g), np.asarray(r)), shape


def test_split_output_dtype_is_one_rounding_of_the_float32_sum():
    """S > 1 with a bf16 output: the float32 sum of the partials, cast once."""
    x = jnp.asarray(RNG.standard_normal((5, 2048)), jnp.bfloat16)
    w = jnp.asarray(RNG.standard_normal((2048, 256)) * 0.1, jnp.bfloat16)
    got = fixed_tile_matmul(x, w)
    assert got.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(got), np.asarray(fixed_tile_matmul(x, w, out_dtype=jnp.float32).astype(jnp.bfloat16)))


def test_xla_dot_is_not_invariant_here():
    """The property above is not vacuous on this backend: XLA's own dot changes rows with M."""
    x = jnp.asarray(RNG.standard_normal((300, 576)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((576, 1536)) * 0.1, jnp.float32)
    full = np.asarray(jnp.dot(x, w))
    slices = [(1, 0), (1, 77), (8, 3), (33, 100), (200, 50), (5, 295)]
    assert any(not np.array_equal(np.asarray(jnp.dot(x[o:o + m], w)), full[o:o + m]) for m, o in slices)


def test_tiles_depend_on_k_and_n_only_and_bad_shapes():
    assert tiles(4096, 4096) == Tiles(bm=32, bn=128, bk=64, splits=8)  # decode q/o: 32 column tiles -> 256
    assert tiles(14336, 4096).splits == 8  # down
    assert tiles(4096, 14336).splits == 4  # gate / up: 112 column tiles -> 448
    assert tiles(4096, 1024).splits == 8  # k / v: capped by MIN_SPLIT_STEPS (64 bk steps / 8)
    assert tiles(4096, 128256).splits == 1  # LM head: 1002 column tiles already
    assert tiles(4096, 4096, 1024, 1024).splits == 8  # q/k/v in one launch: 48 column tiles -> 384
    assert tiles(4096, 14336, 14336).splits == 2  # gate and up in one launch: 224 column tiles -> 448
    assert tiles(64, 256, 40).bn == 32  # the group's smallest column tile
    assert tiles(64, 40) == Tiles(bm=32, bn=32, bk=64, splits=1)  # no pow2 divisor >= 16: shifted last tile
    for K, N in [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256), (2560, 960), (4112, 4096)]:
        t = tiles(K, N)
        nk = K // t.bk
        assert t.splits & (t.splits - 1) == 0 and nk % t.splits == 0
        assert t.splits == 1 or nk // t.splits >= MIN_SPLIT_STEPS
        assert t.splits == 1 or -(-N // t.bn) * (t.splits // 2) < TARGET_PROGRAMS  # the smallest such S
    assert fixed_tile_matmul(jnp.ones((3, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16)).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="K=24 has no power-of-two divisor"):
        fixed_tile_matmul(jnp.ones((2, 24)), jnp.ones((24, 32)))
    with pytest.raises(ValueError, match="N=8 is below"):
        fixed_tile_matmul(jnp.ones((2, 32)), jnp.ones((32, 8)))
    with pytest.raises(ValueError, match="x has K=32"):
        fixed_tile_matmul(jnp.ones((2, 32)), jnp.ones((64, 32)))
    with pytest.raises(ValueError, match="N=8 is below"):
        fixed_tile_matmuls(jnp.ones((2, 32)), [jnp.ones((32, 64)), jnp.ones((32, 8))])


@pytest.mark.parametrize("shape,transposed", [((4096, 1024), False), ((4096, 128256), True), ((64, 40), False),
                                              ((4096, 4096), False), ((2048, 200), False), ((4096, 1000), True)])
def test_lowers_to_triton_for_cuda(shape, transposed):
    """The kernel lowers through jax's Triton backend (cuda platform, traced on this CPU; jax
    assumes compute capability 9.0 without a GPU), split or not: catches constructs the Triton
    lowering refuses. The split count is the launch's third grid axis."""
    K, N = shape
    f = functools.partial(fixed_tile_matmul, w_transposed=transposed, out_dtype=jnp.bfloat16, interpret=False)
    args = [jax.ShapeDtypeStruct((8, K), jnp.bfloat16),
            jax.ShapeDtypeStruct((N, K) if transposed else (K, N), jnp.bfloat16)]
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert f"grid_z = {tiles(K, N).splits} : i32" in text


@pytest.mark.parametrize("M,launch,grid_x,grid_z,warps", [(8, "auto", 1, 8, 4), (2048, "auto", 16, 1, 8),
                                                          (512, "auto", 4, 1, 8), (256, "auto", 4, 1, 4),
                                                          (8, "walk", 1, 1, 4)])
def test_group_lowers_to_triton_for_cuda(M, launch, grid_x, grid_z, warps):
    """q/k/v of an 8B in one launch, split (decode) and walk, through the Triton lowering: 128-row
    tiles on 8 warps from 512 rows (4 x 48 programs), 64-row tiles on 4 warps at 256 (2 x 48 would
    be under one wave)."""
    f = functools.partial(fixed_tile_matmuls, out_dtype=jnp.bfloat16, interpret=False, launch=launch)
    args = [jax.ShapeDtypeStruct((M, 4096), jnp.bfloat16)] + [jax.ShapeDtypeStruct((4096, N), jnp.bfloat16)
                                                               for N in (4096, 1024, 1024)]
    text = jax.jit(lambda x, *ws: f(x, ws)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert f"grid_x = {grid_x} : i32" in text
    assert "grid_y = 48 : i32" in text and f"grid_z = {grid_z} : i32" in text
    assert f"num_warps = {warps} : i32" in text


def test_gpu_probe_dry_run(tmp_path):
    """benchmarks/probes/fixed_tile_probe.py --tiny (interpret mode): it runs, its equality counts
    are zero, and it exercises a split launch (S > 1) as well as a walk."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "probe.json"
    probe = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes", "fixed_tile_probe.py")
    p = subprocess.run([sys.executable, probe, "--tiny", "--out", str(out)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["all_bit_equal"] and d["groups"]["qkv"]["tiles"]["splits"] > 1
    assert all(v == 0 for g in d["groups"].values() for v in g["unequal_elements_vs_full_auto"].values())
    # the sweep sets both launches' row tile (the walk's too) and keeps the default's bits
    p = subprocess.run([sys.executable, probe, "--tiny", "--skip-main", "--sweep", "16x64x4x2", "--sweep-groups", "qkv",
                        "--sweep-launch", "walk", "--iters", "1", "--out", str(out)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = json.loads(out.read_text())["sweep"]["qkv"]
    assert rows["16x64x4x2"]["walk_row_tile"] == 16 and rows["default"]["walk_row_tile"] == 64
    assert rows["16x64x4x2"]["m8_walk_unequal_vs_default"] == 0
    # a fifth field sets the split count (timed as a walk: S ranges); one that does not divide K's
    # bk steps is an error row, not a wrong result
    p = subprocess.run([sys.executable, probe, "--tiny", "--skip-main", "--sweep", "16x64x4x2x1,16x64x4x2x3",
                        "--sweep-groups", "qkv", "--sweep-launch", "walk", "--iters", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = json.loads(out.read_text())["sweep"]["qkv"]
    assert rows["default"]["tiles"]["splits"] > 1 and rows["16x64x4x2x1"]["tiles"]["splits"] == 1
    assert "m8_walk_ms" in rows["16x64x4x2x1"] and "does not divide" in rows["16x64x4x2x3"]["error"]
