"""Mixture of experts: the grouped-matmul expert FFN against a per-token oracle, its expert- and
tensor-parallel forms on fake devices, each MoE family's greedy tokens against transformers through
chunked prefill, prefix-cache hits and preemption, EP/TP engines equal to one device, golden EP
shardings and the errors. (Float32 logits of each family against transformers: test_models.py's
test_family_parity, which runs over every entry of tests.helpers.ARCHS.)"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from tests.helpers import hf_greedy, hf_model

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
N_NEW = 8


def _oracle(x, idx, w, wg, wu, wd, act="silu"):
    """Token by token, choice by choice (the test's oracle, not the engine's method); `act` silu or
    gelu_pytorch_tanh (torch's formula)."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            g, u = x[t] @ wg[e], x[t] @ wu[e]
            a = (0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) if act == "gelu_pytorch_tanh"
                 else g / (1 + np.exp(-g)))
            out[t] += w[t, j] * ((a * u) @ wd[e])
    return out


@pytest.fixture(scope="module")
def ffn_case():
    rng = np.random.default_rng(0)
    T, D, I, E, k = 13, 16, 8, 8, 3
    x = rng.normal(size=(T, D)).astype(np.float32)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    idx[:5] = [0, 1, 2]  # a crowded expert next to empty ones
    w = rng.random((T, k)).astype(np.float32)
    ws = [rng.normal(size=s).astype(np.float32) * 0.3 for s in ((E, D, I), (E, D, I), (E, I, D))]
    return x, idx, w, ws, _oracle(x, idx, w, *ws)


def test_grouped_ffn_matches_oracle(ffn_case):
    from jvllm.ops.grouped_matmul import moe_ffn, sort_by_expert

    x, idx, w, ws, want = ffn_case
    got = jax.jit(moe_ffn)(x, idx, w, *ws)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)
    order, sizes = sort_by_expert(jnp.asarray(idx), 8)
    assert np.asarray(sizes).tolist() == np.bincount(idx.ravel(), minlength=8).tolist()
    assert np.all(np.diff(idx.ravel()[np.asarray(order)]) >= 0)  # rows sorted by expert
    # padding tokens: in no group (no expert reads for them), output 0, the others unchanged
    valid = np.arange(x.shape[0]) % 3 != 0
    _, sizes = sort_by_expert(jnp.asarray(idx), 8, jnp.asarray(valid))
    assert np.asarray(sizes).tolist() == np.bincount(idx[valid].ravel(), minlength=8).tolist()
    got = jax.jit(moe_ffn)(x, idx, w, *ws, jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(got), np.where(valid[:, None], want, 0.0), atol=1e-4, rtol=1e-4)


def test_expert_activation(ffn_case):
    """hidden_act gelu_pytorch_tanh reaches the experts on every path: the sorted one (xla and pallas),
    the pallas decode path, and both sharded routings; an unknown activation is an error naming it."""
    from jvllm.ops import pallas_moe_decode as dec
    from jvllm.ops.grouped_matmul import moe_ffn, sharded_ffn
    from jvllm.sharding import make_mesh, stage_mesh

    x, idx, w, ws, silu = ffn_case
    want = _oracle(x, idx, w, *ws, act="gelu_pytorch_tanh")
    assert np.abs(want - silu).max() > 0.1  # the activation matters at this scale
    for backend in ("xla", "pallas"):
        got = jax.jit(lambda *a: moe_ffn(*a, backend=backend, act="gelu_pytorch_tanh"))(x, idx, w, *ws)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)
    rng = np.random.default_rng(1)  # 2 tokens of top-3 over 8 experts with Triton-sized tiles: the decode path
    dx, dw = rng.normal(size=(2, 32)).astype(np.float32), rng.random((2, 3)).astype(np.float32)
    didx = np.stack([rng.choice(8, 3, replace=False) for _ in range(2)]).astype(np.int32)
    dws = [rng.normal(size=sh).astype(np.float32) * 0.3 for sh in ((8, 32, 16), (8, 32, 16), (8, 16, 32))]
    assert dec.fits(6, 8, dws[0].shape)
    got = jax.jit(lambda *a: moe_ffn(*a, backend="pallas", act="gelu_pytorch_tanh"))(dx, didx, dw, *dws)
    np.testing.assert_allclose(np.asarray(got), _oracle(dx, didx, dw, *dws, act="gelu_pytorch_tanh"),
                               atol=1e-4, rtol=1e-4)
    mesh = stage_mesh(make_mesh(tensor=2, expert=2), 0, 0)
    for routing in ("gather", "all_to_all"):
        got = jax.jit(lambda *a: sharded_ffn(*a, mesh=mesh, expert_axes=("expert",), hidden_axis="tensor",
                                             routing=routing, act="gelu_pytorch_tanh"))(x, idx, w, *ws)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="xielu"):
        moe_ffn(x, idx, w, *ws, act="xielu")


def test_tokamax_backend(ffn_case):
    """tokamax.ragged_dot through the same path (on CPU it runs its XLA implementation)."""
    pytest.importorskip("tokamax")
    from jvllm.ops.grouped_matmul import moe_ffn

    x, idx, w, ws, want = ffn_case
    got = jax.jit(lambda *a: moe_ffn(*a, backend="tokamax"))(x, idx, w, *ws)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


# (expert groups, tensor devices, enable_expert_parallel): experts over "expert" with their hidden
# dimension over "tensor", or (EP) experts over ("expert", "tensor")
FFN_LAYOUTS = [(1, 2, True), (1, 8, True), (2, 4, True), (4, 2, True), (8, 1, True),
               (1, 4, False), (2, 2, False), (4, 2, False), (8, 1, False)]


@pytest.mark.parametrize("routing", ["gather", "all_to_all"])
@pytest.mark.parametrize("ep,tp,expert_parallel", FFN_LAYOUTS)
def test_sharded_ffn(ffn_case, ep, tp, expert_parallel, routing):
    """Every layout of the presets and both routings equal the oracle, padding tokens included
    (T=13 does not divide over the expert shards: the all-to-all pads its chunks)."""
    from jax.sharding import NamedSharding

    from jvllm.ops.grouped_matmul import sharded_ffn
    from jvllm.sharding import make_mesh, moe_mesh_axes, partition_spec, stage_mesh, PRESETS

    x, idx, w, ws, want = ffn_case
    mesh = stage_mesh(make_mesh(tensor=tp, expert=ep), 0, 0)
    rules = PRESETS["expert" if expert_parallel else "tensor"]
    axes = [("expert", "embed", "moe_mlp"), ("expert", "embed", "moe_mlp"), ("expert", "moe_mlp", "embed")]
    placed = [jax.device_put(a, NamedSharding(mesh, partition_spec(ax, rules))) for a, ax in zip(ws, axes)]
    expert_axes, hidden_axis = moe_mesh_axes(expert_parallel)
    f = jax.jit(lambda *a: sharded_ffn(*a, mesh=mesh, expert_axes=expert_axes, hidden_axis=hidden_axis,
                                       routing=routing))
    valid = np.arange(x.shape[0]) >= 4
    np.testing.assert_allclose(np.asarray(f(x, idx, w, *placed)), want, atol=1e-4, rtol=1e-4)
    got = f(x, idx, w, *placed, jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(got), np.where(valid[:, None], want, 0.0), atol=1e-4, rtol=1e-4)


def test_sharded_ffn_errors(ffn_case):
    from jvllm.ops.grouped_matmul import sharded_ffn
    from jvllm.sharding import make_mesh, stage_mesh

    x, idx, w, ws, _ = ffn_case
    m3 = stage_mesh(make_mesh(tensor=3), 0, 0)
    with pytest.raises(ValueError, match=r"8 experts do not split over 3 devices of mesh axes \('tensor',\)"):
        sharded_ffn(x, idx, w, *ws, mesh=m3, expert_axes=("tensor",))
    with pytest.raises(ValueError, match="expert size 8 does not split over 3 devices of mesh axis 'tensor'"):
        sharded_ffn(x, idx, w, *ws, mesh=m3, expert_axes=(), hidden_axis="tensor")
    with pytest.raises(ValueError, match="mesh axis 'data' is not in the mesh"):
        sharded_ffn(x, idx, w, *ws, mesh=m3, expert_axes=("data",))
    with pytest.raises(ValueError, match="unknown expert routing 'scatter'; known: gather, all_to_all"):
        sharded_ffn(x, idx, w, *ws, mesh=m3, expert_axes=(), routing="scatter")


def _llm(path, **kw):
    kw.setdefault("max_model_len", 96)
    kw.setdefault("max_num_batched_tokens", 16)
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("token_buckets", (8, 16))
    return LLM(path, dtype="float32", use_tqdm_on_load=False, **kw)


def _greedy(llm, prompts, n_new=N_NEW):
    sp = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                         use_tqdm=False)]


def _prompts(seed=3):
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 256, 33).tolist()
    return [rng.integers(3, 256, int(n)).tolist() for n in (5, 21, 57, 30, 44, 38)] + [shared + [7, 8], shared + [9]]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "dots1", "ernie4_5_moe",
                                  "minimax_m2", "granitemoeshared", "phimoe", "exaone_moe"])
def test_moe_greedy_matches_transformers(ckpt_dir, arch):
    """One engine per family through every scheduling path at once: 32-token chunks (prompts up to
    57 tokens), a shared 33-token prefix, a second pass served from the prefix cache, and 12
    usable blocks of 8 tokens for 8 requests of up to 69 tokens (preemption)."""
    path = ckpt_dir(arch)
    prompts = _prompts()
    llm = _llm(path, block_size=8, num_gpu_blocks_override=13, max_num_seqs=8, max_num_batched_tokens=32,
               token_buckets=(8, 32))
    try:
        ours = _greedy(llm, prompts, 12)
        again = _greedy(llm, prompts, 12)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    ref = hf_model(path)
    assert ours == [hf_greedy(ref, p, 12) for p in prompts]
    assert again == ours
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0.2
    assert stats["num_free_blocks"] == stats["num_blocks"] - 1
    assert stats["compiles_after_warmup"] == 0


@pytest.fixture(scope="module")
def qwen3_moe_base(ckpt_dir):
    """Qwen3-MoE with 8 query heads and 16 experts (so EP and TP can use all 8 fake devices)."""
    path = ckpt_dir("qwen3_moe", num_attention_heads=8)
    llm = _llm(path, max_num_batched_tokens=32, max_num_seqs=8, token_buckets=(8, 32))
    try:
        return path, _greedy(llm, _prompts())
    finally:
        llm.shutdown()


def _spy_sharded(monkeypatch):
    from jvllm.ops import grouped_matmul as gm

    traced = []

    def spy(*a, _f=gm.sharded_ffn, **k):
        traced.append((k["expert_axes"], k["hidden_axis"], tuple(k["mesh"].shape.items())))
        return _f(*a, **k)

    monkeypatch.setattr(gm, "sharded_ffn", spy)
    return traced


EP_ALL = (("expert", "tensor"), None)   # enable_expert_parallel: experts over every device of a stage
EP_GROUPS = (("expert",), "tensor")     # experts over the groups, each expert's hidden over "tensor"


@pytest.mark.parametrize("kw,want", [
    (dict(tensor_parallel_size=8, enable_expert_parallel=True), (EP_ALL, 1, 8)),
    (dict(tensor_parallel_size=4, expert_parallel_size=2, enable_expert_parallel=True), (EP_ALL, 2, 4)),
    (dict(tensor_parallel_size=2, expert_parallel_size=4), (EP_GROUPS, 4, 2)),
    (dict(tensor_parallel_size=4), (EP_GROUPS, 1, 4)),
    (dict(tensor_parallel_size=2, expert_parallel_size=2, pipeline_parallel_size=2, enable_expert_parallel=True),
     (EP_ALL, 2, 2))], ids=["ep8", "ep2xtp4", "groups4xtp2", "tp4", "ep2xtp2xpp2"])
def test_parallel_moe_equals_one_device(qwen3_moe_base, kw, want, monkeypatch):
    traced = _spy_sharded(monkeypatch)
    path, expected = qwen3_moe_base
    llm = _llm(path, max_num_batched_tokens=32, max_num_seqs=8, token_buckets=(8, 32), **kw)
    try:
        assert _greedy(llm, _prompts()) == expected
        assert llm.get_stats()["compiles_after_warmup"] == 0
    finally:
        llm.shutdown()
    (axes, hidden), e, t = want
    assert traced and set(traced) == {(axes, hidden, (("expert", e), ("tensor", t)))}  # fixed at construction


@pytest.mark.parametrize("arch,base_kw,kw", [
    ("mixtral", dict(num_local_experts=8), dict(tensor_parallel_size=4, expert_parallel_size=2,
                                                enable_expert_parallel=True)),
    ("qwen2_moe", {}, dict(tensor_parallel_size=2, expert_parallel_size=4)),
    ("qwen2_moe", {}, dict(tensor_parallel_size=2, expert_parallel_size=2, enable_expert_parallel=True)),
    ("olmoe", {}, dict(tensor_parallel_size=2, expert_parallel_size=2, enable_expert_parallel=True)),
    ("glm4_moe", {}, dict(tensor_parallel_size=2, expert_parallel_size=2, enable_expert_parallel=True))],
    ids=["mixtral-ep2xtp4", "qwen2_moe-groups4xtp2", "qwen2_moe-ep2xtp2", "olmoe-ep2xtp2", "glm4_moe-ep2xtp2"])
def test_expert_axis_families_equal_one_device(ckpt_dir, arch, base_kw, kw):
    """Mixtral, Qwen2-MoE (shared expert, one dense layer), OLMoE (q/k norms over the sharded
    heads) and GLM-4.5 (grouped sigmoid router, ungated shared expert) on an ("expert", "tensor")
    stage mesh equal one device."""
    path = ckpt_dir(arch, **base_kw)
    prompts = _prompts()[:4]
    outs = []
    for k in ({}, kw):
        llm = _llm(path, **k)
        try:
            outs.append(_greedy(llm, prompts))
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("ep,tp,expert_parallel,name", [(1, 4, True, "ep4"), (1, 8, True, "ep8"),
                                                        (2, 4, True, "ep2xtp4"), (4, 2, False, "groups4xtp2")])
def test_golden_expert_parallel_shardings(ep, tp, expert_parallel, name):
    """The parameter shardings of the MoE presets for a Qwen3-30B-A3B-shaped model (one layer) on
    an ("expert", "tensor") stage mesh."""
    from jvllm.converters import RANDOM_PRESETS
    from jvllm.config import ModelConfig
    from jvllm.models import param_specs
    from jvllm.sharding import describe, make_mesh, parallel_rules, param_shardings, stage_mesh

    import transformers

    d = {k: v for k, v in RANDOM_PRESETS["qwen3-30b-a3b"].items() if k not in ("model_type", "architectures")}
    hf = transformers.Qwen3MoeConfig(**dict(d, num_hidden_layers=1))
    hf.architectures = ["Qwen3MoeForCausalLM"]
    cfg = ModelConfig.from_hf_config(hf)
    mesh = stage_mesh(make_mesh(tensor=tp, expert=ep), 0, 0)
    got = describe(param_shardings(param_specs(cfg), mesh, parallel_rules(cfg, tp, ep, expert_parallel)))
    assert got["layers.0.mlp.expert_gate"] == ("(('expert', 'tensor'), None, None)" if expert_parallel
                                               else "('expert', None, 'tensor')")
    assert got["layers.0.mlp.router"] == "(None, None)"
    assert got["layers.0.self_attn.q_proj"] == "(None, 'tensor', None)"  # attention: "tensor" only
    path = os.path.join(GOLDEN, f"shardings_qwen3-30b-a3b_{name}.json")
    if os.environ.get("JVLLM_UPDATE_GOLDEN"):
        json.dump(got, open(path, "w"), indent=1, sort_keys=True)
    assert got == json.load(open(path))


def test_moe_errors(ckpt_dir, tmp_path):
    from jvllm.config import MoEConfig
    from jvllm.converters import CheckpointError, load_checkpoint
    from jvllm.converters.name_map import map_name

    with pytest.raises(ValueError, match="num_experts_per_tok \\(9\\) exceeds the number of experts \\(8\\)"):
        MoEConfig(num_experts=8, top_k=9, expert_size=4)
    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts model"):
        _llm(ckpt_dir("llama"), tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_size 8 does not fit.*num_experts 4"):
        _llm(ckpt_dir("qwen2_moe"), tensor_parallel_size=8, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="moe_backend must be one of auto, xla, pallas, tokamax; got 'cutlass'"):
        _llm(ckpt_dir("qwen2_moe"), moe_backend="cutlass")
    with pytest.raises(ValueError, match="moe_backend='xla' needs a mixture-of-experts model"):
        _llm(ckpt_dir("llama"), moe_backend="xla")
    assert map_name("model.layers.3.block_sparse_moe.experts.5.w2.weight", "moe")[0] == "layers.3.mlp.expert_down"
    # a checkpoint that lacks one expert names it
    import shutil

    from safetensors.numpy import load_file, save_file

    src = ckpt_dir("mixtral")
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), tmp_path / f)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing expert\(s\) \[2\] of 'layers.1.mlp.expert_up' \(3 of 4\)"):
        load_checkpoint(str(tmp_path))


def test_glm4_moe_config_and_mtp_layers(ckpt_dir, tmp_path):
    """GLM-4.5's router settings reach MoEConfig (and bad ones are errors naming them); the
    next-token-prediction layer a real checkpoint stores after the decoder stack is skipped when
    config.json declares it, and is an unexpected tensor otherwise."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    from jvllm.config import ModelConfig, MoEConfig
    from jvllm.converters import CheckpointError, load_checkpoint

    src = ckpt_dir("glm4_moe")
    m = ModelConfig.from_pretrained(src).moe
    assert (m.scoring, m.correction_bias, m.num_groups, m.topk_groups, m.routed_scaling) == ("sigmoid", True, 4, 2, 2.5)
    assert (m.shared_expert_size, m.shared_expert_gate, m.mlp_only_layers) == (32, False, (0,))
    with pytest.raises(ValueError, match=r"n_group \(3\) does not divide the 8 experts"):
        MoEConfig(num_experts=8, top_k=2, expert_size=4, scoring="sigmoid", num_groups=3)
    with pytest.raises(ValueError, match=r"topk_group \(5\) exceeds n_group \(4\)"):
        MoEConfig(num_experts=8, top_k=2, expert_size=4, num_groups=4, topk_groups=5)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) exceeds the experts of the topk_group \(2\)"):
        MoEConfig(num_experts=8, top_k=5, expert_size=4, num_groups=4, topk_groups=2)
    with pytest.raises(ValueError, match="scoring function 'sqrtsoftplus' is not supported"):
        MoEConfig(num_experts=8, top_k=2, expert_size=4, scoring="sqrtsoftplus")
    with pytest.raises(ValueError, match="the sparsemixer router picks exactly 2 experts; num_experts_per_tok is 3"):
        MoEConfig(num_experts=8, top_k=3, expert_size=4, scoring="sparsemixer")
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), tmp_path / f)
    sd = load_file(str(tmp_path / "model.safetensors"))
    n = 3  # the tiny checkpoint's num_hidden_layers: an MTP layer is stored as layer 3
    sd.update({f"model.layers.{n}.eh_proj.weight": np.zeros((64, 128), np.float32),
               f"model.layers.{n}.self_attn.q_proj.weight": np.zeros((64, 64), np.float32)})
    save_file(sd, str(tmp_path / "model.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1  # transformers' Glm4MoeConfig default (num_mtp_layers)
    cfg["num_nextn_predict_layers"] = 0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"unexpected tensor 'model.layers.{n}"):
        load_checkpoint(str(tmp_path))
    cfg["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ck = load_checkpoint(str(tmp_path))
    assert not any(k.startswith(f"layers.{n}.") for k in ck.params) and "layers.2.mlp.router_bias" in ck.params
    # num_params counts the router bias and the ungated shared expert (not q/k/v biases, q/k norms)
    extra = 3 * (4 + 2 * 2) * 16 + 3 * 2 * 16  # 3 layers: q/k/v biases (4 + 2 x 2 heads of 16), q/k norms
    assert ck.config.num_params == sum(int(p.size) for p in ck.params.values()) - extra


def test_ernie45_moe_layers_and_refusal(ckpt_dir):
    """ERNIE 4.5 MoE's sparse layers from moe_layer_start_index / end / interval, its softmax router
    with a selection bias; use_bias (biases on the shared experts and the LM head) is refused."""
    import json

    from jvllm.config import ModelConfig

    path = ckpt_dir("ernie4_5_moe")
    m = ModelConfig.from_pretrained(path).moe
    assert [i for i in range(4) if m.is_sparse(i)] == [1, 3]
    assert (m.scoring, m.correction_bias, m.shared_expert_size, m.shared_expert_gate) == ("softmax", True, 32, False)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["use_bias"] = True
    from transformers import Ernie4_5_MoeConfig

    with pytest.raises(ValueError, match="Ernie4_5_MoeForCausalLM: config sets use_bias=True, which jvllm does not implement"):
        ModelConfig.from_hf_config(Ernie4_5_MoeConfig(**cfg))


def test_expert_axis_rules_and_errors(ckpt_dir):
    """parallel_rules: the presets as data on the ("expert", "tensor") mesh, and the sizes that do
    not fit named with their numbers."""
    from jvllm.config import ModelConfig
    from jvllm.sharding import PRESETS, make_mesh, moe_mesh_axes, parallel_rules, partition_spec

    moe = ModelConfig.from_pretrained(ckpt_dir("qwen2_moe"))  # 4 experts of 32, shared expert 48, 4 heads
    assert parallel_rules(moe, 2, 2, expert_parallel=True)["expert"] == ("expert", "tensor")
    assert parallel_rules(moe, 2, 4)["expert"] == "expert" and parallel_rules(moe, 2, 4)["moe_mlp"] == "tensor"
    assert parallel_rules(moe, 1, 1) == PRESETS["replicated"]
    assert moe_mesh_axes(True) == (("expert", "tensor"), None) and moe_mesh_axes(False) == (("expert",), "tensor")
    with pytest.raises(ValueError, match=r"enable_expert_parallel: tensor_parallel_size 4 does not fit this model: "
                                         r"num_experts 4 over expert_parallel_size 2 x tensor_parallel_size"):
        parallel_rules(moe, 4, 2, expert_parallel=True)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 1 does not fit.*num_experts 4 over expert_parallel_size 8,"):
        parallel_rules(moe, 1, 8)
    with pytest.raises(ValueError, match="expert_parallel_size must be a positive integer, got 0"):
        parallel_rules(moe, 2, 0)
    dense = ModelConfig.from_pretrained(ckpt_dir("llama"))
    with pytest.raises(ValueError, match="expert_parallel_size 2 needs a mixture-of-experts model; LlamaForCausalLM"):
        parallel_rules(dense, 2, 2)
    with pytest.raises(ValueError, match="map two dimensions of .* onto one mesh axis"):
        partition_spec(("expert", "moe_mlp"), dict(PRESETS["tensor"], expert=("expert", "tensor")))
    with pytest.raises(ValueError, match=r"x expert_parallel_size \(4\) = 16 devices, but only 8"):
        make_mesh(tensor=4, expert=4)
    with pytest.raises(ValueError, match="expert_parallel_size must be a positive integer, got 0"):
        make_mesh(expert=0)
    with pytest.raises(ValueError, match="expert_parallel_size 2 needs a mixture-of-experts model"):
        _llm(ckpt_dir("llama"), tensor_parallel_size=2, expert_parallel_size=2)


def test_random_moe_presets():
    from jvllm.converters import model_config, resolve_model

    big = model_config(resolve_model("random:qwen3-30b-a3b"))
    assert (big.num_layers, big.moe.num_experts, big.moe.top_k, big.moe.expert_size, big.hidden_size,
            big.num_heads, big.num_kv_heads, big.head_dim, big.vocab_size) == (48, 128, 8, 768, 2048, 32, 4, 128, 151936)
    assert 30.4e9 < big.num_params < 30.6e9
    tiny = model_config(resolve_model("random:tiny-moe"))
    assert tiny.architecture == "Qwen3MoeForCausalLM" and tiny.moe.num_experts == 8


BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def test_profile_share_attribution():
    """moe_profile_share: kernels classed through their HLO instruction's op_name scope."""
    import sys

    sys.path.insert(0, os.path.join(BENCH, "probes"))
    from moe_profile_share import attribute, op_names

    hlo = """HloModule jit_step, entry_computation_layout={}
  %sort.3 = s32[8]{0} sort(%p), dimensions={0}, metadata={op_name="jit(step)/moe_routing/sort" source_file="x.py"}
  ROOT %fusion.7 = bf16[8,4]{1,0} fusion(%a, %b), kind=kCustom, metadata={op_name="jit(step)/moe_grouped_matmul/ragged_dot"}
  %fusion.8 = f32[8]{0} fusion(%c), kind=kLoop, metadata={op_name="jit(step)/attention/exp"}
"""
    names = op_names([hlo])
    assert names[("jit_step", "sort.3")] == "jit(step)/moe_routing/sort"
    ev = lambda op, dur: {"ph": "X", "name": op, "dur": dur, "args": {"hlo_module": "jit_step", "hlo_op": op}}  # noqa: E731
    trace = {"traceEvents": [ev("sort.3", 10), ev("fusion.7", 30), ev("fusion.7", 30), ev("fusion.8", 30),
                             {"ph": "X", "name": "memcpy", "dur": 99, "args": {}}]}
    out = attribute(trace, names, steps=2)
    c = out["classes"]
    assert (c["routing"]["share"], c["grouped_matmul"]["share"], c["other"]["share"]) == (0.1, 0.6, 0.3)
    assert c["grouped_matmul"]["ms_per_step"] == 0.03 and out["events_without_op_name"] == 0


def test_grouped_matmul_probe_dry_run(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "gmm.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    p = subprocess.run([sys.executable, os.path.join(BENCH, "probes", "moe_grouped_matmul.py"), "--tiny", "--tokens",
                        "8", "--backends", "xla", "--devices", "4", "--expert-groups", "2", "--routings",
                        "gather,all_to_all", "--iters", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["mode"], r["routing"]) for r in rows} == {
        ("one_device", "-"), ("expert_parallel", "gather"), ("expert_parallel", "all_to_all"),
        ("tensor_parallel", "gather"), ("groups", "gather"), ("groups", "all_to_all")}
    assert all(r["ms"] > 0 for r in rows)
    # the launch sweep (interpreted here): plain, swapped and down-only configs agree
    p = subprocess.run([sys.executable, os.path.join(BENCH, "probes", "moe_grouped_matmul.py"), "--tiny", "--tokens",
                        "8", "--backends", "xla", "--iters", "1", "--sweep", "16x16x16x2x4,16x16x32x2x4/16x32x16x2x4,t16x16x16x2x4",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    sweep = [r for r in json.loads(out.read_text())["rows"] if r["mode"] == "sweep"]
    assert [r["config"] for r in sweep] == ["16x16x16x2x4", "16x16x32x2x4/16x32x16x2x4", "t16x16x16x2x4"]
    assert all(r["max_abs_diff_vs_first"] < 1e-5 and r["gate_up_ms"] > 0 and r["down_ms"] > 0 for r in sweep)
    # chained layers, rounds over the configs, down's own launch
    p = subprocess.run([sys.executable, os.path.join(BENCH, "probes", "moe_grouped_matmul.py"), "--tiny", "--tokens",
                        "8", "--backends", "xla", "--iters", "1", "--chain", "2", "--rounds", "2", "--sweep",
                        "16x16x16x2x4,t16x16x32x2x4/16x32x16x2x4", "--out", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    sweep = [r for r in json.loads(out.read_text())["rows"] if r["mode"] == "sweep"]
    assert [r["config"] for r in sweep] == ["16x16x16x2x4", "t16x16x32x2x4/16x32x16x2x4"]
    assert all(r["chain"] == 2 and len(r["rounds"]) == 2 and r["ms"] > 0 and r["max_abs_diff_vs_first"] < 1e-5
               for r in sweep)


def test_bench_active_weight_bytes():
    """jvllm bench's B1 bytes per step and P1 FLOPs for a MoE model count the top_k experts a token
    reads and multiplies by."""
    from types import SimpleNamespace

    from jvllm.bench import param_stats
    from jvllm.converters import model_config, resolve_model

    mc = model_config(resolve_model("random:tiny-moe"))  # 2 layers, 8 experts, top-2, 64 x 32
    head = jnp.zeros((64, 512), jnp.float32)
    experts = [jnp.zeros((8, 64, 32), jnp.float32) for _ in range(6)]
    runner = SimpleNamespace(stages=[SimpleNamespace(state=[jnp.zeros((512, 64)), *experts])], head_w=head)
    ps = param_stats(SimpleNamespace(llm_engine=SimpleNamespace(runner=runner, model_config=mc)))
    expert_bytes = 6 * 8 * 64 * 32 * 4
    assert ps["weight_bytes"] == (512 * 64 + 64 * 512) * 4 + expert_bytes
    assert ps["active_weight_bytes"] == ps["weight_bytes"] - expert_bytes + expert_bytes * 2 // 8
    assert ps["active_params"] == ps["num_params"] - expert_bytes // 4 + expert_bytes // 4 * 2 // 8
