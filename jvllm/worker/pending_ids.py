"""The ids one step hands the next on the device (`tok_pad`, [max_num_seqs] int32), and how the next
step's first stage reads them.

A row's entry holds its sampled id in the low `ID_BITS` bits. A row verified by spec_verify (n-gram
speculation) also holds, above them, its number of accepted drafts `a`: its entry is the last token
it emitted, and that token sits `a` positions past where the host placed it. So the step after a
verify step can be dispatched before the verify step is read: the host lays such a row out as if
no draft were accepted (position p), and `take_pending` moves its position to p + a and recomputes
its KV slot from the row's block table, which the host made long enough for a = d (every draft).

The shift moves every token of the row (the pending token first, then drafts). Hazard: a row with a
pending token has no tokens before it in the step, and the moved slots' blocks must be in the row's
block table as sent; `InputLayout.prepare` and `LLMEngine.dispatch_ahead` ensure both.
Only the first stage reads the shift: steps that use it run on one stage.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

ID_BITS = 24
ID_MASK = (1 << ID_BITS) - 1
MAX_VOCAB = 1 << ID_BITS


def encode(tok, accepted):
    """Entry of a verified row: its last emitted token `tok` with its accepted count (device ints)."""
    return tok | (accepted << ID_BITS)


def take_pending(prev, src, tokens, md, block_size: int, shifted: bool, decode: bool = False):
    """Input ids [T] (`prev[src[t]]` where src[t] >= 0, else `tokens[t]`) and the attention metadata
    with the positions and slots of shifted rows moved (`shifted`: decided at construction; False
    reads the ids only, as every step without n-gram speculation does). `decode`: the decode-only
    variant (one token per row, tile n = token n), which needs no scatter."""
    got = prev[jnp.maximum(src, 0)]
    if not shifted:
        return jnp.where(src >= 0, got, tokens), md
    ids = jnp.where(src >= 0, got & ID_MASK, tokens)
    T = tokens.shape[0]
    NT, Qt = md.tile_token_idx.shape
    R = md.block_tables.shape[0]
    tok_shift = jnp.where(src >= 0, got >> ID_BITS, 0)
    if decode:
        n = min(NT, T)
        row = jnp.zeros(T, jnp.int32).at[:n].set(md.tile_req[:n])
        shift = tok_shift
    else:  # each token's request row from the tiles (padding tiles point at T, dropped by the slice)
        row = jnp.zeros(T + 1, jnp.int32).at[md.tile_token_idx.reshape(-1)].set(jnp.repeat(md.tile_req, Qt))[:T]
        row_shift = jnp.zeros(R, jnp.int32).at[row].max(tok_shift)
        shift = jnp.where(md.positions >= 0, row_shift[row], 0)
    pos = md.positions + shift
    W = md.block_tables.shape[1]
    blk = md.block_tables[row, jnp.minimum(pos // block_size, W - 1)]
    slots = jnp.where(shift > 0, blk * block_size + pos % block_size, md.slot_mapping)
    return ids, dataclasses.replace(md, positions=pos, slot_mapping=slots)
