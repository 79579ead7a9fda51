"""W1 on one GPU in one device call: jvllm (random:llama3-8b, bf16) vs the HF transformers peer.

Run from the repository root on the device machine (it receives only this repo, not ../shared):

    python benchmarks/gpu_w1_vs_hf.py

Steps: `pip install --no-deps --no-build-isolation -e .`; `jvllm bench all` (W1, then B1 and P1 on
the same engine, one compile) or `jvllm bench throughput` (JVLLM_BENCH=throughput); then
benchmarks/peers/hf_baseline.py (a verbatim copy of shared/peers/hf_baseline.py: B1 eager, W1 with
continuous-batching generate_batch, W1 with padded batches of 64). Prints a table with both
figures and the ratio; writes $OUT/jvllm_w1.json, $OUT/hf_baseline.json, $OUT/w1_vs_hf.json.

Env: NREQ (W1 requests, 256), OUTN (output tokens, 256), OUT (/tmp/out), BUDGET_S (whole-script
wall budget, 570: the device allows 600 s a call), JVLLM_TIMEOUT_S (340), JVLLM_BENCH (all |
throughput), JVLLM_ARGS (extra bench flags), SKIP_HF=1, SKIP_INSTALL=1; MODEL / DTYPE / MAX_MODEL_LEN
(random:llama3-8b / bfloat16 / 4096: P1 needs > 2048) for dry runs elsewhere. Each stage runs under a
timeout so that a slow stage still leaves a table; the HF peer prints JSON as it goes, so figures
it finished before a timeout are kept.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

T0 = time.time()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.get("OUT") or "/tmp/out"
NREQ = int(os.environ.get("NREQ", "256"))
OUTN = int(os.environ.get("OUTN", "256"))
BUDGET = float(os.environ.get("BUDGET_S", "570"))


def left() -> float:
    return BUDGET - (time.time() - T0)


def run(cmd, timeout, log):
    """Run cmd with a timeout, tee its output to $OUT/log; returns (rc, output)."""
    print(f"\n$ {' '.join(map(shlex.quote, cmd))}   (timeout {timeout:.0f}s)", flush=True)
    t = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 1), check=False,
                           env=dict(os.environ, OUT=OUT, NREQ=str(NREQ), OUTN=str(OUTN)))
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc = 124
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    with open(os.path.join(OUT, log), "w") as f:
        f.write(text)
    print("\n".join(text.splitlines()[-25:]))
    print(f"[rc={rc}, {time.time() - t:.0f}s]", flush=True)
    return rc, text


def last_json_line(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def fmt(x, spec=".1f"):
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def main():
    os.makedirs(OUT, exist_ok=True)
    summary = dict(nreq=NREQ, outn=OUTN, stages={})
    if not os.environ.get("SKIP_INSTALL"):
        rc, _ = run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q", "-e", "."],
                    min(120, left()), "pip.log")
        summary["stages"]["pip"] = rc
    jpath = os.path.join(OUT, "jvllm_w1.json")
    which = os.environ.get("JVLLM_BENCH", "all")
    cmd = [sys.executable, "-m", "jvllm.cli", "bench", which, "--model", os.environ.get("MODEL", "random:llama3-8b"),
           "--dtype", os.environ.get("DTYPE", "bfloat16"), "--num-prompts", str(NREQ), "--output-len", str(OUTN),
           "--max-model-len", os.environ.get("MAX_MODEL_LEN", "4096"), "--progress",
           "--output-json", jpath] + shlex.split(os.environ.get("JVLLM_ARGS", ""))
    rc, _ = run(cmd, min(float(os.environ.get("JVLLM_TIMEOUT_S", "340")), left() - 10), "jvllm_bench.log")
    summary["stages"]["jvllm"] = rc
    jv = None
    if os.path.isfile(jpath):
        with open(jpath) as f:
            jv = json.load(f)
    hf = None
    if not os.environ.get("SKIP_HF") and left() > 30:
        rc, text = run([sys.executable, "benchmarks/peers/hf_baseline.py"], left() - 5, "hf_baseline.log")
        summary["stages"]["hf"] = rc
        hpath = os.path.join(OUT, "hf_baseline.json")
        hf = last_json_line(text)
        if os.path.isfile(hpath):
            with open(hpath) as f:
                hf = json.load(f)

    res = (jv or {}).get("results", {})
    w1 = res.get("throughput", res if (jv or {}).get("benchmark") == "throughput" else {})
    b1, p1 = res.get("latency", {}), res.get("prefill", {})
    hf = hf or {}
    hf_pad = hf.get("padded_generate_b64") if isinstance(hf.get("padded_generate_b64"), dict) else {}
    hf_cb = hf.get("cb_generate_batch") if isinstance(hf.get("cb_generate_batch"), dict) else {}
    hf_best = max([d.get("out_tok_s", 0) for d in (hf_pad, hf_cb)] or [0]) or None
    rows = [("W1 output tok/s", w1.get("output_tok_s"), hf_best, "HF best of padded b64 / generate_batch"),
            ("W1 vs HF padded b64", w1.get("output_tok_s"), hf_pad.get("out_tok_s"), ""),
            ("W1 vs HF generate_batch", w1.get("output_tok_s"), hf_cb.get("out_tok_s"), ""),
            (f"B1 decode tok/s (jvllm {b1.get('output_len', '-')} tok)", b1.get("tok_s"), hf.get("b1_decode_tok_s_eager"), "HF eager, 128 tok")]
    table = []
    print(f"\n=== W1 on {((jv or {}).get('device') or {}).get('device_kind', '?')}: {NREQ} requests x {OUTN} tokens, "
          f"{os.environ.get('MODEL', 'random:llama3-8b')}, {os.environ.get('DTYPE', 'bfloat16')} ===")
    print(f"{'figure':<34}{'jvllm':>12}{'HF':>12}{'ratio':>9}  note")
    for name, a, b, note in rows:
        ratio = a / b if a and b else None
        table.append(dict(figure=name, jvllm=a, hf=b, ratio=ratio, note=note))
        print(f"{name:<34}{fmt(a):>12}{fmt(b):>12}{fmt(ratio, '.2f'):>9}  {note}")
    extra = dict(w1_total_tok_s=w1.get("total_tok_s"), w1_elapsed_s=w1.get("elapsed_s"),
                 w1_num_preemptions=w1.get("num_preemptions"), compiles_after_warmup=(jv or {}).get("compiles_after_warmup"),
                 b1_step_ms=b1.get("step_ms"), b1_mbu=b1.get("mbu"), p1_tok_s=p1.get("tok_s"), p1_mfu=p1.get("mfu"),
                 startup=(jv or {}).get("startup"), ceilings=(jv or {}).get("ceilings"), errors=(jv or {}).get("errors"))
    for k, v in extra.items():
        if v is not None and k not in ("startup", "ceilings"):
            print(f"  {k}: {fmt(v, '.3f') if isinstance(v, float) else v}")
    st = extra["startup"] or {}
    if st:
        print(f"  jvllm start-up: load {fmt(st.get('load_s'))}s, compile {fmt(st.get('warmup_compile_s'))}s, "
              f"first token {fmt(st.get('first_token_s'))}s")
    summary.update(table=table, jvllm=extra, hf=hf, versions=(jv or {}).get("versions"), total_s=time.time() - T0)
    with open(os.path.join(OUT, "w1_vs_hf.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"[total {time.time() - T0:.0f}s; JSON in {OUT}]")


if __name__ == "__main__":
    main()
