"""The device-side benchmark scripts' CPU paths: what a GPU call would run must not break unseen."""
import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def test_profile_summary_per_kernel_and_busy_union():
    sys.path.insert(0, BENCH)
    from profile_steps import summarize

    M = lambda pid, tid, kind, name: {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}}  # noqa: E731
    X = lambda pid, tid, name, ts, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    trace = {"traceEvents": [
        M(1, None, "process_name", "/device:GPU:0"), M(1, 7, "thread_name", "stream 7"),
        M(2, None, "process_name", "/host:CPU"), M(2, 9, "thread_name", "python"),
        X(1, 7, "gemm", 0, 100), X(1, 7, "attn", 150, 50), X(1, 7, "gemm", 300, 100),
        X(2, 9, "step", 0, 400), X(2, 9, "dispatch", 10, 100),          # nested: counted once in busy
        X(2, 9, "$profiler.py:271 stop_trace", 500, 10_000),            # the profiler itself: ignored
    ]}
    out = summarize(trace, steps=2)
    dev = out["device_tracks"]["/device:GPU:0 | stream 7"]
    assert abs(dev["busy_ms_per_step"] - 0.125) < 1e-9          # 250 us of kernels over 2 steps
    top = {r["name"]: r for r in dev["top"]}
    assert top["gemm"]["calls"] == 2 and abs(top["gemm"]["share_of_busy"] - 0.8) < 1e-9
    host = out["host_tracks"]["/host:CPU | python"]
    assert abs(host["busy_ms_per_step"] - 0.2) < 1e-9 and all("profiler" not in r["name"] for r in host["top"])
    assert "devices" not in out  # one device: no cross-device overlap to report

    # two devices (pipeline stages): busy 0-100 and 150-200 on GPU 0, 50-175 on GPU 1 -> 75 us at once
    trace["traceEvents"] += [M(3, None, "process_name", "/device:GPU:1"), M(3, 4, "thread_name", "stream 4"),
                             X(3, 4, "gemm", 50, 125)]
    trace["traceEvents"] = [e for e in trace["traceEvents"] if not (e.get("pid") == 1 and e.get("ts") == 300)]
    both = summarize(trace, steps=1)["devices"]
    assert both["busy_ms_per_step"] == {"/device:GPU:0": 0.15, "/device:GPU:1": 0.125}
    assert abs(both["all_busy_ms_per_step"] - 0.075) < 1e-9


def test_handoff_probe_dry_run(tmp_path):
    out = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, os.path.join(BENCH, "probes", "gpu_handoff_probe.py"), "--tiny", "--trials", "3",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    d = json.loads(out.read_text())
    assert set(d["methods"]) == {"device_put", "ppermute"}
    assert all(m["matches"] and m["result_on"].endswith(":1") for m in d["methods"].values())


def test_host_profile_dry_run(tmp_path):
    """host_profile.py on a tiny random model: engine timers and per-function cProfile rows per step."""
    out = tmp_path / "host.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, os.path.join(BENCH, "host_profile.py"), "--model", "random:tiny",
                        "--num-prompts", "4", "--input-len", "8,16", "--output-len", "4", "--max-num-seqs", "4",
                        "--token-buckets", "16,64", "--max-model-len", "128", "--top", "5", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["steps"] > 0 and d["host_ms_per_step"] > 0 and len(d["top_self"]) == 5
    assert any("generate" in r["function"] for r in d["top_cumulative"])  # the profiled call itself


def test_gguf_dequant_bench_dry_run(tmp_path):
    """gguf_dequant.py on a few blocks per type: every kernel type timed both ways, bit-identical."""
    out = tmp_path / "dq.json"
    p = subprocess.run([sys.executable, os.path.join(BENCH, "gguf_dequant.py"), "--values", "8192", "--repeats", "1",
                        "--file", "none", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    d = json.loads(out.read_text())
    assert set(d["per_type"]) == {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
    assert all(v["bit_identical"] and v["jvllm_s"] > 0 and v["gguf_s"] > 0 for v in d["per_type"].values())


def test_cmdbuf_probe_dry_run(tmp_path):
    out = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, os.path.join(BENCH, "probes", "gpu_cmdbuf_probe.py"), "--layers", "2", "--width", "64",
                        "--calls", "3", "--extra-ops", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    d = json.loads(out.read_text())
    assert set(d["results"]) == {"moving", "same_in", "stable", "stable_2", "moving_again"}
    assert all(r["host_us_median"] > 0 and r["wall_us_per_call"] > 0 for r in d["results"].values())


SCRIPTS = os.path.join(BENCH, "scripts")
RESULTS = os.path.join(BENCH, "results")
ROOT = os.path.dirname(BENCH)


def test_device_scripts_parse_source_their_env_and_name_existing_files():
    import glob
    import re

    scripts = sorted(glob.glob(os.path.join(SCRIPTS, "*.sh")))
    assert {os.path.basename(s) for s in scripts} >= {"device_env.sh", "single_gpu_figures.sh", "parallel_figures.sh"}
    for s in scripts:
        p = subprocess.run(["bash", "-n", s], capture_output=True, text=True)
        assert p.returncode == 0, (s, p.stderr)
        text = open(s).read()
        if not s.endswith("device_env.sh"):
            assert 'source "$(dirname "$0")/device_env.sh"' in text, s
        for path in re.findall(r"benchmarks/[\w/]+\.py", text):
            assert os.path.isfile(os.path.join(ROOT, path)), (s, path)


def test_require_card_exits_before_installing(tmp_path):
    """REQUIRE_CARD names the GPU a script needs: on any other machine (here, none) the sourced
    device_env.sh exits 3 at once, before its pip install and before creating $OUT (a name no GPU has)."""
    out = tmp_path / "out"
    cmd = f'source "{os.path.join(SCRIPTS, "device_env.sh")}"; echo continued'
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=tmp_path, timeout=60,
                       env={**os.environ, "REQUIRE_CARD": "NoSuchCard", "OUT": str(out), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 3 and "continued" not in p.stdout and "REQUIRE_CARD=NoSuchCard" in p.stdout
    assert not out.exists()


def test_decode_sweep_finds_gpu_kernels_from_probes():
    p = subprocess.run([sys.executable, os.path.join(BENCH, "probes", "gpu_decode_sweep.py"), "--help"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "--tiny" in p.stdout, p.stderr[-2000:]


def _cited_result_names():
    import re

    docs = "".join(open(os.path.join(ROOT, p)).read() for p in ("README.md", "benchmarks/README.md",
                                                                   "benchmarks/results/INDEX.md"))
    return set(re.findall(r"\b(?:h100|h200|cpu)[\w.-]*\.(?:json|png)\b", docs))


def test_results_keep_exactly_what_the_docs_cite():
    files = set(os.listdir(RESULTS)) - {"INDEX.md"}
    cited = _cited_result_names()
    assert sorted(files - cited) == [], "in results/ but cited by no README nor INDEX.md"
    assert sorted(cited - files) == [], "cited but not in results/"


def _index_rows():
    rows = []
    for line in open(os.path.join(RESULTS, "INDEX.md")):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 6 and cells[0] not in ("what", "---"):
            rows.append(cells)
    return rows


def test_index_columns_agree_with_the_jsons():
    sys.path.insert(0, BENCH)
    from index import describe

    rows = _index_rows()
    with_json = [r for r in rows if r[4].startswith("`")]
    assert len(with_json) > 50 and all(r[1] for r in rows)
    for what, value, device, versions, src, commit in with_json:
        d = describe(os.path.join(RESULTS, src.strip("`")))
        assert (device, versions, commit) == (d.device, d.versions, d.commit), (what, src)


def test_index_describe_reads_commit_device_and_fallbacks(tmp_path):
    sys.path.insert(0, BENCH)
    from index import describe

    bench = {"versions": {"jax": "0.11.2", "jvllm_git": {"commit": "a78ae13+agree_min"}},
             "device": {"platform": "gpu", "device_kind": "NVIDIA H200", "count": 2},
             "benchmark": "latency", "results": {"tok_s": 199.44, "mbu": 0.78}}
    p = tmp_path / "h200x2_b1_a0626a7.json"
    p.write_text(json.dumps(bench))
    d = describe(str(p))
    assert (d.device, d.versions, d.commit) == ("2x NVIDIA H200", "jax 0.11.2", "a78ae13+agree_min")
    assert d.figures == ("B1 199.4 tok/s MBU 78.0%",)
    bench["versions"]["jvllm_git"]["commit"] = "HEAD"    # not a commit: the file name's is used, marked
    p.write_text(json.dumps({"8b": bench}))               # a summary of bench JSONs
    d = describe(str(p))
    assert d.commit == "a0626a7 (name)" and d.device == "2x NVIDIA H200"
    q = tmp_path / "h200x2_probe.json"
    q.write_text(json.dumps({"default": {"allreduce_us": 20.1}}))
    assert (describe(str(q)).device, describe(str(q)).commit) == ("nvidia-h200-x2 (name)", "?")
    q.write_text("[1, 2]")
    try:
        describe(str(q))
    except ValueError as e:
        assert "h200x2_probe.json" in str(e)
    else:
        raise AssertionError("a JSON list was accepted")


def test_serve_replay_dry_run(tmp_path):
    """probes/serve_replay.py on a tiny random model: both modes finish every request and report
    the engine's steps and the busiest threads."""
    out = tmp_path / "replay.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, os.path.join(BENCH, "probes", "serve_replay.py"), "random:tiny",
                        "--num-prompts", "6", "--input-len", "8", "32", "--output-len", "4", "8",
                        "--request-rates", "50,inf", "--max-model-len", "128", "--dtype", "float32",
                        "--output-json", str(out)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(r["mode"], r["request_rate"]) for r in runs] == [("engine", "50"), ("engine", "inf"),
                                                             ("async", "50"), ("async", "inf")]
    for r in runs:
        assert r["completed"] == 6 and r["failed"] == 0 and r["engine"]["num_steps"] > 0
        assert r["total_output_tokens"] >= 6 * 4 and r["threads"]


def test_serve_bench_rates_get_prompts_of_their_own():
    """S1's rates share lengths and arrivals but not token ids, so no rate finds an earlier rate's
    prompts in the prefix cache."""
    sys.path.insert(0, BENCH)
    try:
        import serve_bench
    finally:
        sys.path.remove(BENCH)
    base = serve_bench.build_workload(8, (16, 64), (4, 8), 1000, seed=0)
    assert base == serve_bench.build_workload(8, (16, 64), (4, 8), 1000, seed=0)
    one, two = (serve_bench.build_workload(8, (16, 64), (4, 8), 1000, seed=0, variant=k) for k in (1, 2))
    for w in (one, two):
        assert w[1] == base[1] and [len(p) for p in w[0]] == [len(p) for p in base[0]]
    firsts = {tuple(p[:8]) for w in (base, one, two) for p in w[0]}
    assert len(firsts) == 24  # every prompt of every variant starts differently


def test_ncu_summary_reads_the_raw_csv(tmp_path):
    """probes/ncu_summary.py on a CSV shaped as `ncu --csv --page raw` writes it (ncu's log lines
    mixed in, units in the second row, thousands separators; units as ncu 2025.3 writes them): time in
    us, achieved DRAM GB/s, the
    top stall reasons by cycles per issue."""
    sys.path.insert(0, os.path.join(BENCH, "probes"))
    from ncu_summary import main

    cols = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__bytes.sum.per_second",
            "launch__grid_size", "launch__registers_per_thread",
            "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
            "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
            "smsp__average_warps_issue_stalled_long_scoreboard_not_issued_per_issue_active.ratio"]
    units = ["", "", "ns", "byte/s", "", "register/thread", "", "", ""]
    row = ["0", "jvllm_grouped_matmul_bm64_bn128_bk128", "162,016", "2,825,426,822,042.27", "5,760", "168", "7.5", "0.4", "99"]
    q = lambda r: ",".join(f'"{v}"' for v in r)  # noqa: E731
    csv_path = tmp_path / "raw.csv"
    csv_path.write_text("==PROF== Connected to process 1\n" + "\n".join(map(q, (cols, units, row))) + "\n")
    out = tmp_path / "ncu.json"
    main([str(out), f"moe={csv_path}", "--device", "H100"])
    d = json.load(open(out))
    k = d["runs"]["moe"][0]
    assert d["device"] == "H100" and k["kernel"].startswith("jvllm_grouped_matmul")
    assert k["time_us"] == 162.016 and k["grid"] == 5760 and k["registers"] == 168
    assert k["dram_GBps"] == 2825.427
    assert list(k["top_stalls"]) == ["long_scoreboard", "barrier"]  # the _not_issued twin is left out


def test_candidate_patches_listed_and_apply_in_order(tmp_path):
    """Every patch in benchmarks/candidates is described in its README and still applies to this
    tree, stacked in the README's order (a candidate that no longer applies fails here, not in a
    device call)."""
    import re
    import shutil

    cand = os.path.join(BENCH, "candidates")
    names = re.findall(r"`(\w+)\.patch`", open(os.path.join(cand, "README.md")).read())
    on_disk = sorted(f[:-6] for f in os.listdir(cand) if f.endswith(".patch"))
    assert sorted(set(names)) == on_disk
    for d in ("jvllm", "tests"):
        shutil.copytree(os.path.join(ROOT, d), tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    for name in dict.fromkeys(names):
        p = subprocess.run(["git", "apply", os.path.join(cand, name + ".patch")], cwd=tmp_path,
                           capture_output=True, text=True)
        assert p.returncode == 0, (name, p.stdout, p.stderr)
