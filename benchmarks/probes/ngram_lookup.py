"""Host time of one n-gram proposal per step (k=4, lookup 2..4) as a request grows, on the CPU:
the windowed lookup over the token list (every window of n tokens compared, the list converted to
an array per call: the proposer before 0bdf5f9) against `NgramProposer.propose(p.ids(req))`
(the request's tokens kept as an array; one pass for the last token's earlier positions).

    PYTHONPATH=. python benchmarks/probes/ngram_lookup.py [--output-json FILE]

Each call appends one token (a repeat of an earlier 3-gram, so every lookup matches), as a
decoding request does; the figure is the mean over `--calls` calls at each starting length.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def windowed(token_ids, k: int, lo: int, hi: int) -> list[int]:
    toks = np.asarray(token_ids, np.int64)
    L = len(toks)
    if k <= 0 or L < lo + 1:
        return []
    for n in range(min(hi, L - 1), lo - 1, -1):
        win = np.lib.stride_tricks.sliding_window_view(toks[:L - 1], n)
        hits = np.flatnonzero((win == toks[L - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return [int(t) for t in toks[start:start + k]]
    return []


class _Req:
    def __init__(self, toks):
        self.all_token_ids = toks


def time_one(length: int, calls: int, kept: bool) -> tuple[float, list]:
    from jvllm.spec_decode.ngram import NgramProposer

    rng = np.random.default_rng(0)
    toks = [int(t) for t in rng.integers(0, 32000, length)]
    req, p = _Req(toks), NgramProposer(4, 2, 4)
    out = []
    t = time.perf_counter()
    for i in range(calls):
        toks.append(toks[100 + i % 3])
        out.append(p.propose(p.ids(req), 4) if kept else windowed(toks, 4, 2, 4))
    return (time.perf_counter() - t) / calls * 1e3, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="512,1024,4096,16384")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args()
    from jvllm.bench.env import device_info, versions

    rows = []
    for L in (int(x) for x in a.lengths.split(",")):
        before, d0 = time_one(L, a.calls, kept=False)
        after, d1 = time_one(L, a.calls, kept=True)
        assert d0 == d1, "the two lookups proposed different drafts"
        rows.append(dict(tokens=L, windowed_list_ms=round(before, 4), kept_array_ms=round(after, 4),
                         speedup=round(before / after, 2)))
        print(json.dumps(rows[-1]))
    out = dict(probe="ngram_lookup", k=4, lookup=[2, 4], calls=a.calls, rows=rows, versions=versions(),
               device=device_info())
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
