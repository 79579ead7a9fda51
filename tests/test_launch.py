"""`jvllm launch`: per-process environments, failure propagation (the end-to-end TP=4 run over
two launched processes is in test_sharding.py, next to the other multi-process tests)."""
import os
import subprocess
import sys
import time

import pytest

from jvllm.launch import launch, process_envs


def test_process_envs_slice_visible_gpus():
    envs = process_envs(2, 2, port=1234, base={"CUDA_VISIBLE_DEVICES": "3,5,6,7", "KEEP": "x"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,5", "6,7"]
    assert [e["JVLLM_PROCESS_ID"] for e in envs] == ["0", "1"]
    assert all(e["JVLLM_COORDINATOR"] == "127.0.0.1:1234" and e["JVLLM_NUM_PROCESSES"] == "2" and e["KEEP"] == "x"
               for e in envs)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in process_envs(3, port=1, base={})] == ["0", "1", "2"]


def test_process_envs_refuse_too_few_gpus():
    with pytest.raises(ValueError, match=r"--nproc 2 x --devices-per-process 2 = 4 GPUs, but CUDA_VISIBLE_DEVICES='0,1' lists 2"):
        process_envs(2, 2, base={"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ValueError, match="must be >= 1"):
        process_envs(0)


def test_one_failure_stops_the_others(tmp_path):
    """Process 1 fails at once; process 0 would sleep a minute (as a peer blocked in a collective
    would, forever): the launcher returns process 1's status and stops process 0."""
    code = ("import os, sys, time\n"
            "if os.environ['JVLLM_PROCESS_ID'] == '1':\n    print('boom'); sys.exit(3)\n"
            "time.sleep(60)\n")
    t = time.monotonic()
    rc = launch([sys.executable, "-c", code], 2, log_dir=str(tmp_path), grace_s=5)
    assert rc == 3 and time.monotonic() - t < 30
    assert "boom" in (tmp_path / "process_1.log").read_text()


def test_cli_success_and_usage_errors(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "jvllm.cli", "launch", "--nproc", "2", "--log-dir", str(tmp_path), "--",
                         sys.executable, "-c", "import os; print('pid', os.environ['JVLLM_PROCESS_ID'])"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "pid 0" in ok.stdout, ok.stderr
    assert (tmp_path / "process_1.log").read_text().strip() == "pid 1"
    bad = subprocess.run([sys.executable, "-m", "jvllm.cli", "launch", "--nproc", "2", "--"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no command to launch" in bad.stderr


def test_serve_refuses_several_processes(tmp_path):
    """`jvllm serve` under `jvllm launch`: each process would get other HTTP requests and their
    steps would diverge, so it stops at start-up, before loading, naming the way that works."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    p = subprocess.run([sys.executable, "-m", "jvllm.cli", "launch", "--nproc", "2", "--log-dir", str(tmp_path), "--",
                        sys.executable, "-m", "jvllm.cli", "serve", "random:tiny", "--port", "1"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode != 0
    assert "jvllm serve runs in one process (this run has 2 processes)" in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize("flag", ["-tp", "-pp"])
def test_bench_under_launch_reports_from_process_0(tmp_path, flag):
    """`jvllm bench` on random weights as two processes (TP=2, or PP=2 with one stage per process,
    one CPU device each): process 0 writes the JSON, with the memory table gathered from both
    processes (empty on CPUs, which have no allocator stats), and the other process says it left
    the report to process 0. The engine is as small as the check allows (one token bucket, two
    sequences, an 8 MiB copy probe): every program of its warm-up compiles in both processes."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    out = tmp_path / "b.json"
    p = subprocess.run([sys.executable, "-m", "jvllm.cli", "launch", "--nproc", "2", "--log-dir", str(tmp_path), "--",
                        sys.executable, "-m", "jvllm.cli", "bench", "latency", "--model", "random:tiny", flag, "2",
                        "--input-len", "12", "--output-len", "4", "--num-iters", "1", "--num-iters-warmup", "0",
                        "--max-model-len", "64", "--max-num-batched-tokens", "16", "--token-buckets", "16",
                        "--max-num-seqs", "2", "--copy-bytes", str(8 << 20), "--no-xla-report", "--output-json", str(out)],
                       capture_output=True, text=True, timeout=400, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    import json

    d = json.loads(out.read_text())
    assert d["results"]["output_len"] == 4 and d["memory"]["per_device"] == []
    assert "process 1: done (process 0 writes the JSON)" in (tmp_path / "process_1.log").read_text()


def test_memory_report_lists_devices_with_stats(monkeypatch):
    import jax

    from jvllm import bench

    class Dev:
        def __init__(self, i, stats):
            self.i, self.stats = i, stats

        def memory_stats(self):
            return self.stats

        def __str__(self):
            return f"fake:{self.i}"

    class Eng:
        class runner:
            kv, num_blocks, block_size, kv_dtype = [], 3, 16, "bfloat16"

    class LLMish:
        llm_engine = Eng()

    devs = [Dev(0, dict(peak_bytes_in_use=5, bytes_in_use=4, bytes_limit=9)), Dev(1, None)]
    monkeypatch.setattr(jax, "local_devices", lambda: devs)
    monkeypatch.setattr(bench.facts, "param_stats", lambda llm: dict(weight_bytes=1))
    r = bench.memory_report(LLMish())
    assert r["per_device"] == [dict(device="fake:0", peak_bytes_in_use=5, bytes_in_use=4, bytes_limit=9)]
