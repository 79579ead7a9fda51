"""Tensor / pipeline / data parallelism on 8 fake CPU devices: identical greedy tokens, golden
parameter shardings, multi-process TP, Orbax restore onto another mesh."""
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.config import ModelConfig
from jvllm.sharding import describe, make_mesh, param_shardings, tensor_parallel_rules

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
SP = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[3, 4, 5, 6, 7], list(range(10, 37)), [200, 1, 2] * 6]


def _llm(path, **kw):
    return LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8,
               token_buckets=(8, 32), use_tqdm_on_load=False, **kw)


def _run(path, prompts=PROMPTS, **kw):
    llm = _llm(path, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SP, use_tqdm=False)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    assert stats["compiles_after_warmup"] == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def base(ckpt_dir):
    path = ckpt_dir("llama", num_hidden_layers=4)
    return path, _run(path)


def test_eight_devices():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("kw", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=4),
                                dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2, pipeline_parallel_size=2),
                                dict(data_parallel_size=2), dict(pipeline_parallel_size=4, num_microbatches=3)],
                         ids=["tp2", "tp4", "pp2", "tp2pp2", "dp2", "pp4mb3"])
def test_parallel_greedy_identical(base, kw):
    path, expected = base
    assert _run(path, **kw) == expected


def test_stage_weights_and_kv_live_on_their_own_devices(base):
    llm = _llm(base[0], tensor_parallel_size=2, pipeline_parallel_size=2)
    stages = llm.llm_engine.runner.stages
    devs = [{d.id for a in jax.tree_util.tree_leaves((st.state, st.kv)) for d in a.sharding.device_set}
            for st in stages]
    assert devs == [{0, 1}, {2, 3}]
    k0 = stages[0].kv[0][0]
    assert k0.sharding.spec[0] == "tensor" and k0.addressable_shards[0].data.shape[0] == 1  # 2 KV heads / TP 2
    llm.shutdown()


def test_smollm2_tensor_parallel(smollm2_llm):
    """The real model at the TP size its 9 heads / 3 KV heads allow."""
    tok = smollm2_llm.get_tokenizer()
    prompts = [tok("The capital of France is")["input_ids"], tok("def add(a, b):")["input_ids"]]
    single = [o.outputs[0].token_ids for o in smollm2_llm.generate([{"prompt_token_ids": p} for p in prompts], SP,
                                                                   use_tqdm=False)]
    llm = LLM("smollm2", dtype="float32", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=2,
              token_buckets=(16,), use_tqdm_on_load=False, tensor_parallel_size=3)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SP, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == single


def test_unsupported_tp_size_is_a_clear_error():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not fit this model: num_attention_heads 9, "
                                         r"num_key_value_heads 3, intermediate_size 1536; sizes that work: 1, 3"):
        tensor_parallel_rules(cfg, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) x pipeline_parallel_size \(4\) x "
                                         r"data_parallel_size \(1\) = 16 devices, but only 8"):
        make_mesh(tensor=4, stage=4)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_golden_param_shardings(tp):
    """The parameter shardings each TP size produces for a Llama-3-8B-shaped model."""
    from jvllm.converters import RANDOM_PRESETS
    from jvllm.models import param_specs

    import transformers

    cfg = ModelConfig.from_hf_config(transformers.LlamaConfig(**dict(RANDOM_PRESETS["llama3-8b"], num_hidden_layers=1)))
    mesh = make_mesh(tensor=tp).devices[0, 0]
    from jax.sharding import Mesh

    got = describe(param_shardings(param_specs(cfg), Mesh(mesh, ("tensor",)), tensor_parallel_rules(cfg, tp)))
    path = os.path.join(GOLDEN, f"shardings_llama3-8b_tp{tp}.json")
    if os.environ.get("JVLLM_UPDATE_GOLDEN"):
        json.dump(got, open(path, "w"), indent=1, sort_keys=True)
    assert got == json.load(open(path))


def test_orbax_saved_tp1_restored_tp2_pp2(base, tmp_path):
    from jvllm.converters import convert_to_orbax

    path, expected = base
    dst = str(tmp_path / "orbax")
    convert_to_orbax(path, dst)
    llm = _llm(dst, tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        q = llm.llm_engine.runner.stages[1].state["layers"][0]["self_attn"]["q_proj"]
        arr = q.get_value() if hasattr(q, "get_value") else q.value
        assert {d.id for d in arr.sharding.device_set} == {2, 3} and arr.sharding.spec[1] == "tensor"
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected


WORKER = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
from jvllm.sharding import initialize_distributed
initialize_distributed(sys.argv[3], 2, int(sys.argv[1]))
import jax
from jvllm import LLM, SamplingParams
llm = LLM(sys.argv[2], dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8,
          token_buckets=(8, 32), use_tqdm_on_load=False, tensor_parallel_size=4)
prompts = json.loads(sys.argv[4])
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
print("RESULT", json.dumps([o.outputs[0].token_ids for o in outs]), jax.process_count(), len(jax.devices()))
"""


def test_two_processes_tp4(base, tmp_path):
    path, expected = base
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, str(script), str(i), path, f"127.0.0.1:{port}", json.dumps(PROMPTS)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for i in range(2)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        line = [x for x in out.splitlines() if x.startswith("RESULT")]
        assert line, out[-3000:]
        results.append(line[0].split(" ", 1)[1])
    for r in results:
        toks, nproc, ndev = r.rsplit(" ", 2)
        assert json.loads(toks) == expected and nproc == "2" and ndev == "4"
