"""The MoE decode path (jvllm.ops.pallas_moe_decode, interpret mode on CPU): each (token, choice)
pair against a per-token oracle, padding and other devices' pairs adding 0, windows at the end of
the pair table, bfloat16; moe_ffn / sharded_ffn taking it exactly at decode-sized steps of the
pallas backend, and its errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.ops import pallas_moe_decode as dec
from tests.test_moe import _oracle


def _case(T, D, I, E, k, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(T, D)).astype(np.float32)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.random((T, k)).astype(np.float32)
    ws = [rng.normal(size=s).astype(np.float32) * 0.3 for s in ((E, D, I), (E, D, I), (E, I, D))]
    return x, idx, w, ws


@pytest.mark.parametrize("T,D,I,E,k", [(1, 32, 16, 8, 3), (5, 64, 32, 8, 2), (21, 16, 16, 4, 3)])
def test_decode_ffn_matches_oracle(T, D, I, E, k):
    """Pairs of padding tokens (-1) add 0; T=21 puts pairs in the last rows of the 16-row windows."""
    x, idx, w, ws = _case(T, D, I, E, k)
    valid = np.arange(T) % 3 != 1
    pairs = np.where(valid[:, None], idx, -1).reshape(-1)
    got = jax.jit(dec.decode_ffn)(x, jnp.asarray(pairs), w, *ws)
    assert got.dtype == jnp.float32 and got.shape == (T, D)
    want = np.where(valid[:, None], _oracle(x, idx, w, *ws), 0.0)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


def test_decode_ffn_bfloat16():
    x, idx, w, ws = _case(3, 64, 32, 8, 2, seed=1)
    want = _oracle(x, idx, w, *ws)
    got = dec.decode_ffn(jnp.asarray(x, jnp.bfloat16), jnp.asarray(idx.reshape(-1)), w,
                         *[jnp.asarray(a, jnp.bfloat16) for a in ws])
    np.testing.assert_allclose(np.asarray(got), want, atol=0.05 * np.abs(want).max())


def _pallas_names(f, *args):
    text = str(jax.make_jaxpr(f)(*args))
    return {n for n in ("jvllm_moe_decode_gate_up", "jvllm_moe_decode_down", "jvllm_grouped_matmul") if n in text}


def test_moe_ffn_takes_the_decode_path_at_decode_sizes():
    """T * k <= min(MAX_PAIRS, E): the two decode kernels and no grouped matmul; above: the sorted
    path; the xla backend never; both paths equal the oracle."""
    from jvllm.ops.grouped_matmul import moe_ffn

    k, E = 2, 8  # E bounds the pairs: 4 tokens of top-2
    for T, want in ((E // k, {"jvllm_moe_decode_gate_up", "jvllm_moe_decode_down"}),
                    (E // k + 1, {"jvllm_grouped_matmul"})):
        x, idx, w, ws = _case(T, 32, 16, E, k, seed=T)
        f = lambda *z: moe_ffn(*z, backend="pallas")  # noqa: E731
        assert _pallas_names(f, x, idx, w, *ws) == want
        np.testing.assert_allclose(np.asarray(jax.jit(f)(x, idx, w, *ws)), _oracle(x, idx, w, *ws),
                                   atol=1e-4, rtol=1e-4)
    assert _pallas_names(lambda *z: moe_ffn(*z, backend="xla"), x[:4], idx[:4], w[:4], *ws) == set()
    assert not dec.fits(4, 8, (8, 24, 16))  # no power-of-two tile >= 16 divides D=24
    assert dec.fits(dec.MAX_PAIRS, 128, (128, 2048, 768)) and not dec.fits(dec.MAX_PAIRS + 8, 256, (256, 2048, 768))
    assert not dec.fits(0, 8, (8, 32, 16)) and not dec.fits(8, 1024, (1024, 4096, 1024))  # 2**32 elements
    assert dec.fits(8, 1024, (128, 4096, 1024))  # a device's eighth of them under EP


@pytest.mark.parametrize("ep,tp,expert_parallel", [(1, 4, True), (2, 2, False), (1, 4, False)])
def test_sharded_decode_path(ep, tp, expert_parallel):
    """The gather routing on fake devices: each device's pairs of its own experts (others' -1),
    its share of the hidden dimension under TP, one psum; equal to the oracle with padding."""
    from jax.sharding import NamedSharding

    from jvllm.ops.grouped_matmul import sharded_ffn
    from jvllm.sharding import PRESETS, make_mesh, moe_mesh_axes, partition_spec, stage_mesh

    x, idx, w, ws = _case(5, 32, 64, 16, 3, seed=2)  # 15 pairs of 16 experts; I=64: 16 per device at TP=4
    mesh = stage_mesh(make_mesh(tensor=tp, expert=ep), 0, 0)
    rules = PRESETS["expert" if expert_parallel else "tensor"]
    axes = [("expert", "embed", "moe_mlp"), ("expert", "embed", "moe_mlp"), ("expert", "moe_mlp", "embed")]
    placed = [jax.device_put(a, NamedSharding(mesh, partition_spec(ax, rules))) for a, ax in zip(ws, axes)]
    ex, hid = moe_mesh_axes(expert_parallel)
    f = lambda *z: sharded_ffn(*z, mesh=mesh, expert_axes=ex, hidden_axis=hid, backend="pallas")  # noqa: E731
    valid = jnp.asarray(np.arange(5) != 2)
    assert "jvllm_moe_decode_down" in _pallas_names(f, x, idx, w, *placed, valid)
    want = np.where(np.asarray(valid)[:, None], _oracle(x, idx, w, *ws), 0.0)
    np.testing.assert_allclose(np.asarray(jax.jit(f)(x, idx, w, *placed, valid)), want, atol=1e-4, rtol=1e-4)


def test_decode_ffn_errors():
    x, idx, w, ws = _case(2, 32, 16, 8, 2)
    with pytest.raises(ValueError, match="disagree"):
        dec.decode_ffn(x, jnp.asarray(idx.reshape(-1)[:3]), w, *ws)
    big = _case(dec.MAX_PAIRS // 2 + 1, 32, 16, 8, 2)
    with pytest.raises(ValueError, match=f"{dec.MAX_PAIRS + 2} pairs .at most {dec.MAX_PAIRS}"):
        dec.decode_ffn(big[0], jnp.asarray(big[1].reshape(-1)), big[2], *big[3])


def test_decode_probe_dry_run(tmp_path):
    import json
    import os
    import subprocess
    import sys

    probes = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes")
    out = tmp_path / "dec.json"
    p = subprocess.run([sys.executable, os.path.join(probes, "moe_decode_probe.py"), "--tiny", "--tokens", "1,4",
                        "--valid", "1", "--iters", "1", "--sweep", "32x32x4x4/16x32x4x4", "--out", str(out)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.path.join(probes, "..", ".."),
                                JAX_CAPTURED_CONSTANTS_WARN_BYTES="1000"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    # weights passed as arguments: captured as constants, the real shape's 19 GB stalled the lowering
    assert "captured during lowering" not in p.stderr, p.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tokens"], r["path"]) for r in rows] == [
        (t, n) for t in (1, 4) for n in ("sorted", "decode", "decode 32x32x4x4/16x32x4x4")]
    assert all(r["ms_per_layer"] > 0 and r["valid"] == 1 for r in rows)


@pytest.mark.parametrize("T,k,launches", [(8, 8, {}), (1, 8, dict(gate_up=dec.Launch(32, 256, 4, 3))),
                                          (2, 8, dict(act="gelu_pytorch_tanh"))])
def test_lowers_to_triton_for_cuda(T, k, launches):
    """Both kernels lower through jax's Triton backend at Qwen3-30B-A3B's layer shape (cuda platform,
    traced on this CPU; jax assumes compute capability 9.0): catches constructs Triton refuses."""
    E, D, I = 128, 2048, 768
    args = [jax.ShapeDtypeStruct((T, D), jnp.bfloat16), jax.ShapeDtypeStruct((T * k,), jnp.int32),
            jax.ShapeDtypeStruct((T, k), jnp.float32), jax.ShapeDtypeStruct((E, D, I), jnp.bfloat16),
            jax.ShapeDtypeStruct((E, D, I), jnp.bfloat16), jax.ShapeDtypeStruct((E, I, D), jnp.bfloat16)]
    f = lambda *z: dec.decode_ffn(*z, interpret=False, **launches)  # noqa: E731
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2


def test_launch_override_probe(monkeypatch):
    """benchmarks/probes/moe_decode_launch.py: 'GU/DN' becomes the launches every later trace of the
    decode path uses (keyword defaults included); a malformed spec names itself."""
    import os
    import re

    probes = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes")
    monkeypatch.syspath_prepend(probes)
    import moe_decode_launch as m

    assert m.parse("default") == (dec.GATE_UP, dec.DOWN)
    assert m.parse("32x256x4x3/16x64x2x5") == (dec.Launch(32, 256, 4, 3), dec.Launch(16, 64, 2, 5))
    with pytest.raises(SystemExit, match="'32x256/16'"):
        m.parse("32x256/16")
    monkeypatch.setattr(dec, "GATE_UP", dec.GATE_UP)
    monkeypatch.setattr(dec, "DOWN", dec.DOWN)
    monkeypatch.setattr(dec.expert_rows, "__kwdefaults__", dict(dec.expert_rows.__kwdefaults__))
    called = []
    monkeypatch.setattr("jvllm.cli.main", lambda argv: called.append(argv) or 0)
    assert m.main(["16x32x4x4/16x32x2x3", "bench", "latency"]) == 0 and called == [["bench", "latency"]]
    E, D, I, T, k = 8, 64, 32, 2, 2
    jp = jax.make_jaxpr(lambda x: dec.expert_rows(x, jnp.zeros(T * k, jnp.int32), jnp.ones((T, k)),
                                                  jnp.ones((E, D, I)), jnp.ones((E, D, I)), jnp.ones((E, I, D))))(
        jnp.ones((T, D)))
    names = set(re.findall(r"jvllm_moe_decode_\w+", str(jp)))
    assert names == {"jvllm_moe_decode_gate_up_bn16_bk32", "jvllm_moe_decode_down_bn16_bk32"}, names
