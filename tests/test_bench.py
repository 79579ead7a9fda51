"""The benchmark harness (jvllm/bench/) end to end through the CLI, on random:tiny, CPU.

To stay fast, the four CLI runs share one engine: `build_llm` is wrapped so the first run constructs
it and later runs with the same engine flags reuse it (its shutdown deferred to the end of the
module). The compile counter's base is reset on reuse, since each run's probes (copy bandwidth,
matmul) compile their own programs before the "construction" a real run would do at that point."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jvllm import bench
from jvllm.cli import main as cli_main

ENGINE = ["--model", "random:tiny", "--max-model-len", "256", "--max-num-batched-tokens", "64",
          "--max-num-seqs", "8", "--token-buckets", "16,64", "--compilation-cache-dir", "off"]
FAST = ["--num-iters", "2", "--num-iters-warmup", "1", "--copy-bytes", str(8 << 20), "--matmul-n", "256"]


@pytest.fixture(scope="module")
def shared_engine():
    cache = {}
    real = bench.run.build_llm

    def build(model, kw):
        key = (model, json.dumps(kw, sort_keys=True, default=str))
        if key not in cache:
            llm, st = real(model, kw)
            cache[key] = (llm, st, llm.shutdown)
            llm.shutdown = lambda: None
        else:
            llm, st, _ = cache[key]
            llm.llm_engine.compiles_after_warmup_base = llm.llm_engine.worker.compile_count()
        return llm, dict(st)

    mp = pytest.MonkeyPatch()
    mp.setattr(bench.run, "build_llm", build)
    yield cache
    mp.undo()
    for _, _, shutdown in cache.values():
        shutdown()


def run_cli(tmp_path, *args) -> dict:
    out = tmp_path / "r.json"
    cli_main(["bench", *args, *ENGINE, *FAST, "--output-json", str(out)])
    d = json.loads(out.read_text())
    for k in ("versions", "device", "config", "startup", "engine_stats", "xla_programs"):
        assert k in d, k
    assert d["versions"]["jax"] and d["versions"]["python"]
    assert d["device"]["platform"] == "cpu" and d["device"]["count"] >= 1
    assert d["compiles_after_warmup"] == 0
    assert d["startup"]["construct_s"] > 0 and d["startup"]["first_token_s"] > 0
    parts = d["startup"]["init_parts"]  # the start-up beyond load and warm-up, split
    assert set(parts) == {"backend_init_s", "model_config_s", "tokenizer_s", "build_stages_s", "kv_sizing_s",
                          "runner_s", "block_pool_s"} and all(v >= 0 for v in parts.values())
    assert sum(parts.values()) <= d["startup"]["init_s"] - d["startup"]["warmup_compile_s"]
    assert d["xla_programs"]["summary"]["step"]["programs"] >= 2  # token buckets 16, 64 (+ variants)
    steps = [p for name, p in d["xla_programs"]["programs"].items() if name.startswith("step")]
    assert steps and all(p["flops"] > 0 and p["fusion_ops"] > 0 for p in steps)
    return d


def test_w1_prompts_match_the_spec():
    n = 5
    rng = np.random.default_rng(0)
    lens = rng.integers(64, 1025, n)
    want = [rng.integers(100, 128000, l).tolist() for l in lens]
    assert bench.w1_prompts(n) == want  # llama3 vocab: ids untouched
    small = bench.w1_prompts(n, (8, 16), vocab=512)
    assert all(8 <= len(p) <= 16 and max(p) < 512 for p in small)
    assert len({tuple(p) for p in small}) == n


def test_throughput_cli(tmp_path, shared_engine):
    d = run_cli(tmp_path, "throughput", "--num-prompts", "6", "--input-len", "8,40", "--output-len", "5")
    r = d["results"]
    assert r["num_requests"] == 6 and r["output_tokens"] == 30 and r["all_finished_by_length"]
    assert r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"]
    assert r["compiles_after_warmup"] == 0 and r["compiles_in_window"] == 0 and r["num_preemptions"] == 0
    assert r["host_ms_per_step"] > 0 and 0 < r["host_share"] < 1 and r["host_prepare_ms_per_step"] > 0
    # the two phases split the window: first tokens of all requests, then the remaining decodes
    assert 0 < r["prefill_phase_s"] < r["elapsed_s"]
    assert abs(r["prefill_phase_s"] + r["decode_phase_s"] - r["elapsed_s"]) < 1e-9
    assert d["memory"]["weight_bytes"] > 0 and d["memory"]["kv_pool_bytes_global"] > 0
    assert d["config"]["sampling"] == dict(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0)


def test_throughput_cli_sampled(tmp_path, shared_engine):
    """--temperature / --top-p / --min-p: the same workload through the general sampler."""
    d = run_cli(tmp_path, "throughput", "--num-prompts", "4", "--input-len", "8,20", "--output-len", "4",
                "--temperature", "0.8", "--top-p", "0.9", "--min-p", "0.05")
    assert d["config"]["sampling"] == dict(temperature=0.8, top_p=0.9, top_k=-1, min_p=0.05)
    assert d["results"]["output_tokens"] == 16 and d["results"]["compiles_after_warmup"] == 0
    assert d["results"]["host_sample_call_ms_per_step"] > 0


def test_latency_cli(tmp_path, shared_engine):
    d = run_cli(tmp_path, "latency", "--input-len", "20", "--output-len", "6")
    r = d["results"]
    assert r["tok_s"] > 0 and r["step_ms"] > 0 and len(r["iterations"]) == 2
    assert r["iterations"][0]["decode_steps"] == 5 and r["iterations"][0]["output_tokens"] == 6
    assert r["weight_bytes"] > 0 and r["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # 2 layers, 2 kv heads, hd 16
    assert 0 < r["mbu"] and d["ceilings"]["copy_bandwidth_Bps"] > 0


def test_prefill_cli(tmp_path, shared_engine):
    d = run_cli(tmp_path, "prefill", "--input-len", "60")
    r = d["results"]
    assert r["tok_s"] > 0 and r["steps"] == 1 and r["input_len"] == 60
    assert 0 < r["mfu"] and d["ceilings"]["matmul_flops_per_s"] > 0 and d["ceilings"]["matmul_n"] == 256


def test_all_cli_one_engine(tmp_path, shared_engine):
    d = run_cli(tmp_path, "all", "--num-prompts", "3", "--w1-input-len", "8,20", "--output-len", "3",
                "--b1-input-len", "10", "--b1-output-len", "4", "--prefill-len", "50")
    assert set(d["results"]) == {"throughput", "latency", "prefill"}
    assert d["results"]["throughput"]["output_tokens"] == 9
    assert len(shared_engine) == 1  # every run above used one engine


def test_cap_input_len():
    assert bench.cap_input_len((64, 1024), 256, 2048) == ((64, 1024), None)
    (lo, hi), note = bench.cap_input_len((64, 1024), 256, 512)
    assert (lo, hi) == (64, 256) and "capped to 64..256" in note and "max_model_len 512" in note
    assert bench.cap_input_len((300, 400), 100, 256)[0] == (156, 156)
    with pytest.raises(ValueError, match="--output-len 512 leaves no room for a prompt: max_model_len is 512"):
        bench.cap_input_len((64, 1024), 512, 512)


def test_throughput_cli_caps_prompts_to_a_short_context(tmp_path, shared_engine, capsys):
    d = run_cli(tmp_path, "throughput", "--num-prompts", "3", "--input-len", "200,400", "--output-len", "20")
    r = d["results"]
    assert r["input_len"] == [200, 236] and r["input_len_asked"] == [200, 400]
    assert r["output_tokens"] == 60 and r["all_finished_by_length"]
    assert "W1: prompt lengths 200..400 capped to 200..236" in capsys.readouterr().err
