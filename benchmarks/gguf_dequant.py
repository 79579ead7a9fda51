"""GGUF dequantization on the CPU: jvllm's block kernels (`converters.gguf_dequant`) against the
`gguf` package's own (`gguf.quants.dequantize`, what jvllm used for these types before, and what
transformers uses), per block type and on a real file's every tensor.

    PYTHONPATH=. python benchmarks/gguf_dequant.py [--values 4194304] [--repeats 5] [--file auto|PATH|none]
        [--out benchmarks/results/cpu_gguf_dequant_<commit>.json]

Per type: random valid blocks (`tests.gguf_util.random_kquant` for the super-block types,
`gguf.quants.quantize` of random values for Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1), the best of `--repeats` runs of
each implementation, interleaved, and a bit-for-bit comparison of their outputs. `--file auto`
also dequantizes every tensor of the built-in Gemma 3 270M GGUF (Q4_K_M: Q4_K, Q6_K, Q8_0 and F32
tensors) both ways. Single-threaded numpy either way: the machine's load inflates both alike.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KERNEL_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def _blocks(qtype: str, n: int, rng) -> np.ndarray:
    import gguf

    from tests.gguf_util import _KQ, random_kquant

    if qtype in _KQ:
        return random_kquant(qtype, n // 1024, 1024, rng).reshape(-1)
    x = rng.standard_normal((n // 1024, 1024)).astype(np.float32)
    return gguf.quants.quantize(x, gguf.GGMLQuantizationType[qtype]).reshape(-1)


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def per_type(n: int, repeats: int) -> dict:
    import gguf

    from jvllm.converters.gguf_dequant import dequantize

    rng = np.random.default_rng(0)
    out = {}
    for qt in KERNEL_TYPES:
        Q = gguf.GGMLQuantizationType[qt]
        raw = _blocks(qt, n, rng)
        ours = dequantize(raw, Q, (n,))
        theirs = np.asarray(gguf.quants.dequantize(raw, Q), np.float32).reshape(n)
        t_ours = _best(lambda: dequantize(raw, Q, (n,)), repeats)
        t_gguf = _best(lambda: gguf.quants.dequantize(raw, Q), repeats)
        out[qt] = dict(values=n, jvllm_s=t_ours, gguf_s=t_gguf, jvllm_mvalues_per_s=n / t_ours / 1e6,
                       gguf_mvalues_per_s=n / t_gguf / 1e6, speedup=t_gguf / t_ours,
                       bit_identical=bool(np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))))
        print(f"{qt:5s} jvllm {out[qt]['jvllm_mvalues_per_s']:7.1f} M/s   gguf {out[qt]['gguf_mvalues_per_s']:6.1f} M/s"
              f"   {out[qt]['speedup']:.2f}x   bit-identical {out[qt]['bit_identical']}", flush=True)
    return out


OLD_KERNELS = ("Q8_0", "Q4_0", "Q4_1")  # jvllm's own kernels before the Q5 and K-quant ones


def whole_file(path: str) -> dict:
    """Every tensor of `path` dequantized by jvllm's reader and by gguf's kernels, timed per type;
    `jvllm_before_s`: what the reader took before its Q5 and K-quant kernels (its own kernels for
    OLD_KERNELS, gguf's for the rest), from the same timings. Each tensor's bytes are read once
    before either is timed (the file's pages in memory: neither side pays the disk)."""
    import gguf

    from jvllm.converters.gguf import _reader
    from jvllm.converters.gguf_dequant import dequantize

    r = _reader(path)
    by_type: dict = {}
    same = True
    for t in r.tensors:
        Q = gguf.GGMLQuantizationType(t.ggml_type)
        raw = r.tensor_bytes(t)
        raw.sum(dtype=np.uint64)  # fault the pages in
        t0 = time.perf_counter()
        a = dequantize(raw, Q, t.numpy_shape)
        t1 = time.perf_counter()
        b = raw.view(np.float32) if Q.name == "F32" else np.asarray(gguf.quants.dequantize(raw, Q), np.float32)
        t2 = time.perf_counter()
        row = by_type.setdefault(Q.name, dict(values=0, jvllm_s=0.0, gguf_s=0.0))
        row["values"] += int(np.prod(t.shape))
        row["jvllm_s"] += t1 - t0
        row["gguf_s"] += t2 - t1
        same = same and np.array_equal(a.reshape(-1).view(np.uint32), np.ascontiguousarray(b).reshape(-1).view(np.uint32))
    now = sum(v["jvllm_s"] for v in by_type.values())
    before = sum(v["jvllm_s"] if q in OLD_KERNELS + ("F32",) else v["gguf_s"] for q, v in by_type.items())
    res = dict(file=os.path.basename(path), by_type=by_type, jvllm_s=now, jvllm_before_s=before,
               gguf_s=sum(v["gguf_s"] for v in by_type.values()), speedup_vs_before=before / now,
               bit_identical=bool(same))
    print(f"{res['file']}: jvllm {now:.2f} s (before its Q5 / K-quant kernels {before:.2f} s, {before / now:.2f}x), "
          f"gguf {res['gguf_s']:.2f} s; bit-identical {same}", flush=True)
    for q, v in by_type.items():
        print(f"  {q:5s} {v['values'] / 1e6:7.1f} M values: jvllm {v['jvllm_s']:.2f} s, gguf {v['gguf_s']:.2f} s")
    return res


def main():
    from jvllm.bench import device_info, versions, write_json
    from jvllm.bench.env import git_commit

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--values", type=int, default=1 << 22, help="values per type (a multiple of 1024)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--file", default="auto", help="auto (the built-in gemma3 GGUF), a .gguf path, or none")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    result = dict(benchmark="gguf_dequant", versions=versions(), device=device_info(),
                  per_type=per_type(a.values, a.repeats))
    path = a.file
    if path == "auto":
        from jvllm.converters import resolve_model

        path = resolve_model("gemma3").path
    if path != "none":
        result["file"] = whole_file(path)
    commit = (git_commit() or {}).get("commit") or "unknown"
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                f"cpu_gguf_dequant_{commit.split('+')[0][:7]}.json")
    write_json(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
