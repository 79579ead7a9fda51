"""InputLayout.prepare (the host side of every step) against a plain per-request loop."""
from types import SimpleNamespace

import numpy as np
import pytest

from jvllm.worker.inputs import InputLayout


def _runner(bs=4, W=16, buckets=(8, 16, 32, 64), max_num_seqs=8, qt=4, num_blocks=200):
    return InputLayout(buckets, max_num_seqs, qt, bs, num_blocks, W)


def _reference(r, scheduled, decode, T, R, prev_rows):
    bs = r.block_size
    Qt, NT = r.tiling(T, decode)
    tokens, src = np.zeros(T, np.int32), np.full(T, -1, np.int32)
    positions, slots = np.full(T, -1, np.int32), np.full(T, r.num_blocks * bs, np.int32)
    tables = np.zeros((R, r.table_width), np.int32)
    tile_idx, tile_req = np.full((NT, Qt), T, np.int32), np.zeros(NT, np.int32)
    logits_idx = np.zeros(R, np.int32)
    off = tile = 0
    for i, s in enumerate(scheduled):
        n, start = s.num_tokens, s.start
        pos = np.arange(start, start + n)
        known = s.req.all_token_ids[start:start + n]
        tokens[off:off + len(known)] = known
        if len(known) < n:
            src[off + n - 1] = prev_rows[s.req.request_id]
        positions[off:off + n] = pos
        bt = np.asarray(s.block_ids, np.int32)
        tables[i, :len(bt)] = bt
        slots[off:off + n] = bt[pos // bs] * bs + pos % bs
        for q0 in range(0, n, Qt):
            q1 = min(n, q0 + Qt)
            tile_idx[tile, :q1 - q0] = np.arange(off + q0, off + q1)
            tile_req[tile] = i
            tile += 1
        logits_idx[i] = off + n - 1
        off += n
    return tokens, src, positions, slots, tables, tile_idx, tile_req, logits_idx


@pytest.mark.parametrize("seed", range(6))
def test_prepare_matches_reference(seed):
    rng = np.random.default_rng(seed)
    r = _runner()
    decode_only = seed % 2 == 1
    nreq = int(rng.integers(1, 9))
    scheduled, prev_rows, used = [], {}, 1
    for i in range(nreq):
        ctx = int(rng.integers(1, 50))
        n = 1 if decode_only else int(rng.integers(1, min(ctx, 7) + 1))
        pending = bool(rng.integers(0, 2)) and n >= 1
        ids = rng.integers(0, 1000, ctx - (1 if pending else 0)).tolist()
        nblk = -(-ctx // 4)
        blocks = list(range(used, used + nblk))
        used += nblk
        req = SimpleNamespace(all_token_ids=ids, request_id=f"r{i}")
        if pending:
            prev_rows[f"r{i}"] = int(rng.integers(0, 8))
        scheduled.append(SimpleNamespace(req=req, num_tokens=n, start=ctx - n, block_ids=blocks))
    p = r.prepare(scheduled, prev_rows=prev_rows)
    T, R, decode, tokens, md, src = p.T, p.R, p.decode, p.tokens, p.md, p.src
    ref = _reference(r, scheduled, decode, T, R, prev_rows)
    got = (tokens, src, md.positions, md.slot_mapping, md.block_tables, md.tile_token_idx, md.tile_req, md.logits_indices)
    for name, a, b in zip("tokens src positions slots tables tile_idx tile_req logits_idx".split(), got, ref):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert decode == (decode_only and r.has_decode_variant(T))


def test_prepare_refuses_unknown_input_tokens():
    r = _runner()
    req = SimpleNamespace(all_token_ids=[1, 2, 3], request_id="a")
    sched = [SimpleNamespace(req=req, num_tokens=2, start=3, block_ids=[1, 2])]
    with pytest.raises(RuntimeError, match="request a: 2 input tokens are not known"):
        r.prepare(sched, prev_rows={"a": 0})
