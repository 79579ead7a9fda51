"""PNG plots from benchmark JSON files (jvllm bench, cpu_vs_hf.py, gpu_w1_vs_hf.py).

    python benchmarks/plot.py RESULT.json [MORE.json | DIR ...] [--out-dir DIR]

Writes, per input where it applies: <name>_throughput.png (jvllm vs HF, output tok/s),
<name>_startup.png (load / compile / first token, and cold start with an empty vs warm
compilation cache), <name>_b1_steps.png (B1 decode step time per iteration) and, across all
inputs, summary_figures.png. Exits 0 with a message when matplotlib is not installed.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys


def load(paths):
    out = []
    for p in paths:
        files = sorted(glob.glob(os.path.join(p, "*.json"))) if os.path.isdir(p) else [p]
        for f in files:
            try:
                with open(f) as fh:
                    out.append((os.path.splitext(os.path.basename(f))[0], json.load(fh)))
            except (OSError, ValueError) as e:
                print(f"skip {f}: {e}", file=sys.stderr)
    return out


def bars(plt, path, title, labels, values, ylabel, colors=None):
    pairs = [(lab, v) for lab, v in zip(labels, values) if isinstance(v, (int, float))]
    if not pairs:
        return None
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(pairs) + 2), 3.6))
    b = ax.bar([p[0] for p in pairs], [p[1] for p in pairs], color=colors[:len(pairs)] if colors else None)
    ax.bar_label(b, fmt="%.1f")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_one(plt, name, d, out_dir) -> list[str]:
    made = []
    p = lambda suffix: os.path.join(out_dir, f"{name}_{suffix}.png")
    if d.get("benchmark") == "cpu_vs_hf":
        r = d.get("ratio")
        made.append(bars(plt, p("throughput"), f"CPU, SmolLM2-135M fp32, {d['config']['num_prompts']} x "
                         f"{d['config']['output_len']} tokens" + (f" (ratio {r:.2f}x)" if r else ""),
                         ["jvllm", "HF generate"], [d.get("jvllm", {}).get("out_tok_s"), d.get("hf", {}).get("out_tok_s")],
                         "output tokens/s", ["tab:blue", "tab:gray"]))
    if "table" in d and "nreq" in d:  # gpu_w1_vs_hf summary
        rows = [t for t in d["table"] if t.get("jvllm") or t.get("hf")]
        labels, vals = [], []
        for t in rows[:1] + rows[3:4]:
            short = t["figure"].split()[0]  # W1 / B1
            labels += [f"{short} jvllm", f"{short} HF"]
            vals += [t.get("jvllm"), t.get("hf")]
        made.append(bars(plt, p("throughput"), f"GPU, Llama-3-8B shape bf16, W1 {d['nreq']} x {d['outn']}",
                         labels, vals, "tokens/s", ["tab:blue", "tab:gray"] * 4))
    st = d.get("startup")
    if st:
        labels = ["load", "compile", "first token\n(from start)"]
        vals = [st.get("load_s"), st.get("warmup_compile_s"), st.get("first_token_s")]
        for lab, c in (d.get("cold_start") or {}).items():
            if isinstance(c, dict) and "process_start_to_first_token_s" in c:
                labels.append(f"cold start\n{lab.replace('_', ' ')}")
                vals.append(c["process_start_to_first_token_s"])
        made.append(bars(plt, p("startup"), f"{d.get('config', {}).get('model')}: start-up seconds", labels, vals,
                         "seconds"))
    res = d.get("results") or {}
    b1 = res.get("latency") if d.get("benchmark") == "all" else (res if d.get("benchmark") == "latency" else None)
    if b1 and b1.get("iterations"):
        fig, ax = plt.subplots(figsize=(5, 3.4))
        its = b1["iterations"]
        ax.bar(range(len(its)), [it.get("step_ms_mean", 0) for it in its], label="mean")
        ax.plot(range(len(its)), [it.get("step_ms_min", 0) for it in its], "k_", markersize=20, label="min")
        if b1.get("roofline_step_ms"):
            ax.axhline(b1["roofline_step_ms"], color="tab:red", ls="--", label="bandwidth roofline")
        ax.set_xticks(range(len(its)))
        ax.set_xlabel("iteration")
        ax.set_ylabel("ms per decode step")
        mbu = f", MBU {b1['mbu']:.0%}" if b1.get("mbu") else ""
        ax.set_title(f"B1 {b1['input_len']}+{b1['output_len']} tokens{mbu}", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(p("b1_steps"), dpi=120)
        plt.close(fig)
        made.append(p("b1_steps"))
    return [m for m in made if m]


def plot_summary(plt, items, out_dir):
    labels, vals = [], []
    for name, d in items:
        res = d.get("results") or {}
        sections = res if d.get("benchmark") == "all" else {d.get("benchmark"): res}
        for k, v in sections.items():
            if isinstance(v, dict):
                key = {"throughput": "output_tok_s", "latency": "tok_s", "prefill": "tok_s"}.get(k)
                if key and isinstance(v.get(key), (int, float)):
                    labels.append(f"{name}\n{k}")
                    vals.append(v[key])
    if not labels:
        return None
    path = os.path.join(out_dir, "summary_figures.png")
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(labels) + 1.2))
    b = ax.barh([lab.replace("\n", "  ") for lab in labels], vals)
    ax.bar_label(b, fmt="%.1f", fontsize=8)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (W1: output tokens/s; B1 decode; P1 prefill)")
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title("jvllm bench figures", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="JSON files or folders of them")
    ap.add_argument("--out-dir", default=None, help="default: next to the first input")
    a = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return 0
    items = load(a.inputs)
    first = a.inputs[0]
    out_dir = a.out_dir or (first if os.path.isdir(first) else os.path.dirname(os.path.abspath(first)))
    os.makedirs(out_dir, exist_ok=True)
    made = []
    for name, d in items:
        made += plot_one(plt, name, d, out_dir)
    s = plot_summary(plt, items, out_dir)
    if s:
        made.append(s)
    for m in made:
        print(m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
