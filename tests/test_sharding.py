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
    llm.llm_engine.wait_for_warmup()  # compiles count from the end of the background warm-up
    assert llm.llm_engine.warmup_done()  # what the server's jvllm:warmup_pending reads (dp: every replica)
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


# TP=2, TP=4 and PP=2 alone meet the same one-device tokens in test_tensor_parallel_kernels_run_per_device
# (TP=2, 4), test_executable_cache_on_meshes (TP=2, PP=2) and test_pipeline_budget_is_per_microbatch
# (PP=2), and compile nothing after warm-up in test_parallel_async_scheduling_matches_sync: each engine
# on a mesh costs seconds of compiles, so none is built twice for the same check
@pytest.mark.parametrize("kw", [dict(tensor_parallel_size=2, pipeline_parallel_size=2), dict(data_parallel_size=2),
                                dict(pipeline_parallel_size=4, num_microbatches=3)],
                         ids=["tp2pp2", "dp2", "pp4mb3"])
def test_parallel_greedy_identical(base, kw):
    path, expected = base
    assert _run(path, **kw) == expected


def test_pipeline_budget_is_per_microbatch(base):
    """PP=2: the scheduler fills each micro-batch up to max_num_batched_tokens (32 here), so one
    step carries more than 32 tokens while no micro-batch exceeds the largest bucket; tokens as on
    one device."""
    from jvllm.worker import microbatches

    path, expected = base
    llm = _llm(path, pipeline_parallel_size=2, async_scheduling=False)
    sizes = []
    orig = microbatches.split

    def spy(*args, **kw):
        out = orig(*args, **kw)
        sizes.append([sum(s.num_tokens for _, s in g) for g, _ in out])
        return out

    microbatches.split = spy
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, use_tqdm=False)
    finally:
        microbatches.split = orig
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(n <= 32 for step in sizes for n in step), sizes
    assert sizes[0] == [23, 27], sizes  # 5 + 18 prompt tokens in micro-batch 0, 27 in micro-batch 1
    assert all(len(step) == 2 for step in sizes), sizes


def test_pipelined_loop_abort_and_late_arrivals(base):
    """PP=2 with async scheduling (one step in flight per micro-batch): a request aborted while its
    micro-batch's step is in flight and requests added mid-run leave the others' tokens as on one
    device, every block returns to the pool and nothing compiles."""
    path, expected = base
    llm = _llm(path, pipeline_parallel_size=2)
    eng = llm.llm_engine
    eng.wait_for_warmup()
    try:
        assert eng.async_scheduling and eng.sched_config.num_microbatches == 2
        eng.add_request("p0", {"prompt_token_ids": PROMPTS[0]}, SP)
        eng.add_request("x", {"prompt_token_ids": list(range(40, 70))}, SamplingParams(max_tokens=50, ignore_eos=True))
        got, steps = {}, 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    got[out.request_id] = out.outputs[0]
            steps += 1
            if steps == 3:
                assert eng.loop.in_flight() == 2  # both micro-batches have a step in flight
                eng.abort_request("x")
                eng.add_request("p1", {"prompt_token_ids": PROMPTS[1]}, SP)
            if steps == 5:
                eng.add_request("p2", {"prompt_token_ids": PROMPTS[2]}, SP)
        eng.drain()
        assert [got[f"p{i}"].token_ids for i in range(3)] == expected
        assert "x" not in got and "x" not in eng.groups  # aborted: no final output, nothing kept
        st = eng.get_stats()
        assert st["num_free_blocks"] == st["num_blocks"] - 1 and st["compiles_after_warmup"] == 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("opt", [dict(pipeline_handoff="ppermute"), dict(pipeline_stage_threads=True)])
def test_deleted_pipeline_options_are_refused(base, opt):
    """Stage threads and the in-process ppermute hand-off were measured to lose and are gone: an
    unknown option, named."""
    with pytest.raises(TypeError, match=rf"unknown option\(s\) \['{next(iter(opt))}'\]"):
        _llm(base[0], pipeline_parallel_size=2, **opt)


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
    mesh = make_mesh(tensor=tp).devices[0, 0, 0]
    from jax.sharding import Mesh

    got = describe(param_shardings(param_specs(cfg), Mesh(mesh, ("tensor",)), tensor_parallel_rules(cfg, tp)))
    path = os.path.join(GOLDEN, f"shardings_llama3-8b_tp{tp}.json")
    if os.environ.get("JVLLM_UPDATE_GOLDEN"):
        json.dump(got, open(path, "w"), indent=1, sort_keys=True)
    assert got == json.load(open(path))


def test_tp2_shard_preset_is_one_devices_share():
    """random:llama3-8b-tp2-shard (the one-GPU stand-in for a TP=2 device's work in the B1
    benchmarks) has exactly the per-device parameter shapes of llama3-8b at TP=2."""
    import transformers
    from jax.sharding import Mesh

    from jvllm.converters import RANDOM_PRESETS
    from jvllm.models import param_specs

    def cfg(name):
        return ModelConfig.from_hf_config(transformers.LlamaConfig(**dict(RANDOM_PRESETS[name], num_hidden_layers=1)))

    full, share = cfg("llama3-8b"), cfg("llama3-8b-tp2-shard")
    mesh = Mesh(make_mesh(tensor=2).devices[0, 0, 0], ("tensor",))
    shardings = param_shardings(param_specs(full), mesh, tensor_parallel_rules(full, 2))
    per_device = {n: shardings[n].shard_shape(shape) for n, (shape, _, _) in param_specs(full).items()}
    assert per_device == {n: shape for n, (shape, _, _) in param_specs(share).items()}


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
kw = json.loads(sys.argv[5])
blocks = kw.pop("blocks_per_process", None)  # each process derives its own pool size
if blocks:
    kw["num_gpu_blocks_override"] = blocks[int(sys.argv[1])]
llm = LLM(sys.argv[2], dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8,
          token_buckets=(8, 32), use_tqdm_on_load=False, **kw)
print("BLOCKS", llm.llm_engine.runner.num_blocks)
prompts = json.loads(sys.argv[4])
if llm.llm_engine.runner.multiprocess:  # stages over processes: logprobs refused, naming the values
    try:
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2, logprobs=1), use_tqdm=False)
    except ValueError as e:
        print("LPERR", e)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
print("ASYNC", llm.llm_engine.async_scheduling)
print("SWAPS", llm.llm_engine.runner.num_swaps)
print("RESULT", json.dumps([o.outputs[0].token_ids for o in outs]), jax.process_count(), len(jax.devices()))
"""


@pytest.mark.parametrize("kw", [dict(tensor_parallel_size=4, blocks_per_process=[40, 30]),
                                dict(tensor_parallel_size=2, pipeline_parallel_size=2, blocks_per_process=[24, 30]),
                                dict(tensor_parallel_size=2, pipeline_parallel_size=2, async_scheduling=False),
                                dict(tensor_parallel_size=2, pipeline_parallel_size=2, orbax=True),
                                dict(pipeline_parallel_size=2),
                                dict(tensor_parallel_size=2, data_parallel_size=2)],
                         # the synchronous loop over processes: tp2_pp2_sync (a tp4_sync case, 46 s in a
                         # two-worker run, took no path that this case and tp4_async do not)
                         ids=["tp4_async", "tp2_pp2_async", "tp2_pp2_sync", "tp2_pp2_orbax", "pp2_one_owner_refused",
                              "tp2_dp2_refused"])
def test_two_processes(base, tmp_path, kw):
    """Two processes of two CPU devices each (gloo collectives). TP=4 across them, and TP=2 x PP=2
    with one stage per process (hidden states and sampled ids cross through collective-permute
    programs both processes call): the single-device tokens, with the async loop (the default)
    and the synchronous one; with stages over processes logprobs are refused. Processes that
    size their KV pools differently agree on the smallest before compiling (on GPUs each process
    measures its own device; different shapes hung both in XLA's shared autotuning). PP=2 on the
    first two devices (both in process 0, process 1 would own no stage) and data-parallel
    replicas across processes are refused at start-up, naming the sizes. `orbax`: the params
    saved by `jvllm convert` at TP=1, restored by each process straight into its own stage."""
    path, expected = base
    kw = dict(kw)
    if kw.pop("orbax", False):
        from jvllm.converters import convert_to_orbax

        path = str(tmp_path / "orbax")
        convert_to_orbax(base[0], path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, str(script), str(i), path, f"127.0.0.1:{port}", json.dumps(PROMPTS),
                               json.dumps(kw)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for i in range(2)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        if kw.get("data_parallel_size", 1) > 1:  # replicas cannot span processes: a clear start-up error
            assert "data_parallel_size=2 needs a single-process run (got 2 processes)" in out, out[-3000:]
            continue
        if kw.get("tensor_parallel_size", 1) == 1 and kw.get("pipeline_parallel_size", 1) > 1:
            assert "pipeline_parallel_size=2 over 2 processes: process(es) [1] would own neither" in out, out[-3000:]
            continue
        if kw.get("pipeline_parallel_size", 1) > 1:
            assert "LPERR logprobs=1, prompt_logprobs=None: logprobs are not available with pipeline stages" in out, \
                out[-3000:]
        line = [x for x in out.splitlines() if x.startswith("RESULT")]
        assert line, out[-3000:]
        assert f"ASYNC {kw.get('async_scheduling', True)}" in out, out[-3000:]
        if kw.get("pipeline_parallel_size", 1) > 1 and kw.get("async_scheduling", True):
            # hidden states and the previous micro-batch's ids crossed in one program (_swap)
            swaps = int([x for x in out.splitlines() if x.startswith("SWAPS")][0].split()[1])
            assert swaps > 0, out[-3000:]
        if "blocks_per_process" in kw:
            assert f"BLOCKS {min(kw['blocks_per_process'])}" in out, out[-3000:]
        results.append(line[0].split(" ", 1)[1])
    for r in results:
        toks, nproc, ndev = r.rsplit(" ", 2)
        assert json.loads(toks) == expected and nproc == "2" and ndev == "4"


LAUNCHED = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
from jvllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8,
          token_buckets=(8, 32), use_tqdm_on_load=False, tensor_parallel_size=4)
import jax
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
print("RESULT", jax.process_index(), jax.process_count(), json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def test_jvllm_launch_tp4_over_two_processes(base, tmp_path):
    """`jvllm launch --nproc 2`: a plain script that builds LLM(tensor_parallel_size=4) (no
    distributed set-up of its own) runs as two processes of two CPU devices each, and both give
    the single-device tokens."""
    path, expected = base
    script = tmp_path / "plain.py"
    script.write_text(LAUNCHED)
    logs = tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, "-m", "jvllm.cli", "launch", "--nproc", "2", "--log-dir", str(logs), "--",
                        sys.executable, str(script), path, json.dumps(PROMPTS)],
                       capture_output=True, text=True, timeout=400, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    lines = [x for x in p.stdout.splitlines() + (logs / "process_1.log").read_text().splitlines()
             if x.startswith("RESULT")]
    assert sorted(x.split(" ", 3)[1] for x in lines) == ["0", "1"]
    for x in lines:
        _, _, nproc, toks = x.split(" ", 3)
        assert nproc == "2" and json.loads(toks) == expected


@pytest.mark.parametrize("kw", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2)],
                         ids=["pp2", "tp2"])
def test_parallel_async_scheduling_matches_sync(base, kw):
    """Async scheduling on a mesh: TP (one stage over two devices) and PP (two stages, two
    micro-batches, each with its own step in flight, whose pending tokens stay in their own group
    and cross from the last stage's devices to the first's on the device) give the synchronous
    loop's outputs exactly, with
    sampling, n=2, stop ids, logprobs and a pool too small for every request at once."""
    from jvllm.worker.model_runner import ModelRunner

    path = base[0]
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 250, rng.integers(4, 30))] for _ in range(7)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    stop_id = None

    def run(async_on, params):
        llm = _llm(path, async_scheduling=async_on, num_gpu_blocks_override=24, block_size=8, **kw)
        llm.llm_engine.wait_for_warmup()
        runner = llm.llm_engine.runner
        seen = []
        orig = ModelRunner.dispatch

        def spy(sched, prev=None):
            h = orig(runner, sched, prev)
            seen.append((prev is not None, len(h.pending), frozenset(s.req.microbatch for s in sched)))
            return h

        runner.dispatch = spy
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            st = llm.get_stats()
        finally:
            llm.shutdown()
        assert st["compiles_after_warmup"] == 0 and st["num_free_blocks"] == st["num_blocks"] - 1
        return [[(c.token_ids, c.finish_reason, [sorted((k, round(v.logprob, 4)) for k, v in e.items())
                                                 for e in (c.logprobs or [])]) for c in o.outputs] for o in outs], seen

    stop_id = run(False, greedy)[0][0][0][0][4]
    params = [SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id]),
              SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=11, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=3, n=2, ignore_eos=True),
              SamplingParams(max_tokens=1, temperature=0),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.7, seed=5, ignore_eos=True)]
    sync_out, sync_seen = run(False, params)
    async_out, async_seen = run(True, params)
    assert not any(a for a, *_ in sync_seen) and sum(a for a, *_ in async_seen) > 5, async_seen
    if "pipeline_parallel_size" in kw:
        # synchronous steps carry both micro-batches; async ones are one micro-batch's step each,
        # dispatched ahead of that micro-batch's step in flight, both micro-batches in turn
        assert sum(n == 2 for _, n, _ in sync_seen) > 3, sync_seen
        ahead = [mb for a, n, mb in async_seen if a]
        assert all(len(mb) == 1 for mb in ahead), async_seen
        assert ahead.count(frozenset({0})) > 3 and ahead.count(frozenset({1})) > 3, async_seen
    assert async_out == sync_out
    assert async_out[0][0][1] == "stop" and async_out[0][0][0][-1] == stop_id


@pytest.mark.parametrize("backend", ["ragged_interpret", "xla"])
@pytest.mark.parametrize("tp", [2, 4], ids=["tp2_kv_sharded", "tp4_kv_replicated"])
def test_tensor_parallel_kernels_run_per_device(base, tp, backend):
    """Pallas kernels under TP run inside shard_map on each device's KV heads: same greedy tokens
    as one device, and the compiled step programs gather nothing (XLA cannot split a custom call,
    so under plain GSPMD it would all-gather the layer's whole KV pool onto every device); their
    only collectives are all-reduces (TP=4 with 2 KV heads: replicated pools, sliced per device,
    which copies the slice; with sharded pools nothing is copied)."""
    import re

    from jvllm.compilation import temp_bytes

    path, expected = base
    llm = _llm(path, tensor_parallel_size=tp, attention_backend=backend, num_gpu_blocks_override=2000)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, use_tqdm=False)
        runner = llm.llm_engine.runner
        pool_shard = runner.stages[0].kv[0][0].addressable_shards[0].data.nbytes
        for key in [(0, 32, False), (0, 8, True)]:
            exe = runner.programs.get("step", key)
            hlo = exe.as_text()
            ops = re.findall(r"= \S+ (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", hlo)
            assert ops and set(ops) == {"all-reduce"}, (key, sorted(set(ops)))
            temp = temp_bytes(exe)  # sharded pools are updated and read in place: no copy of one layer's shard
            if tp == 2:
                assert temp is None or temp < pool_shard, (key, temp, pool_shard)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("kw", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_executable_cache_on_meshes(base, kw, tmp_path):
    """TP and PP engines load every program from jvllm's executable cache on the second start
    (multi-device executables onto their mesh's devices) and generate the same tokens."""
    from jvllm import compilation as jc

    path, expected = base
    try:
        stats = []
        for _ in range(2):
            s0 = jc.executable_cache_stats()
            llm = _llm(path, compilation_cache_dir=str(tmp_path / "xla"), warmup="all", **kw)
            llm.llm_engine.wait_for_warmup()
            n = sum(map(len, llm.llm_engine.runner.warmup_keys()))
            try:
                outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, use_tqdm=False)
            finally:
                llm.shutdown()
            assert [o.outputs[0].token_ids for o in outs] == expected
            s1 = jc.executable_cache_stats()
            stats.append({k: s1[k] - s0[k] for k in s1})
    finally:
        jc.disable_persistent_cache()
    assert stats == [dict(loaded=0, stored=n, failed=0, skipped=0), dict(loaded=n, stored=0, failed=0, skipped=0)], stats
