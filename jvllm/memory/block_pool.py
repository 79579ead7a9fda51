"""Host-side KV block bookkeeping (plain Python, no jax): the block pool and the KV cache manager.

Invariants (after vLLM v1's core/block_pool.py and kv_cache_manager.py):
- Block 0 is the null block: never handed out; padded slots of a step point into it.
- A block is in the free queue iff its ref_cnt == 0. The queue is LRU: blocks are appended at the
  tail when freed and taken from the head when allocated, in O(1) (intrusive doubly linked list,
  so a prefix-cache hit can also pull a block out of the middle in O(1)).
- A full block may carry a hash (chained: H(parent hash, its token ids)); `cached` maps hash ->
  block. A freed cached block keeps its hash and stays reusable until it is taken from the head of
  the free queue for a new allocation, which evicts the hash.
- A request's block table is append-only while it runs; on finish / abort / preemption its blocks
  are released in reverse order (tail blocks first into the queue, so they are evicted first).
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Sequence


class Block:
    __slots__ = ("id", "ref_cnt", "hash", "prev", "next")

    def __init__(self, bid: int):
        self.id = bid
        self.ref_cnt = 0
        self.hash: bytes | None = None
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self):
        return f"Block({self.id}, ref={self.ref_cnt}, cached={self.hash is not None})"


class FreeQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[Block]):
        self.head = Block(-1)
        self.tail = Block(-2)
        self.head.next, self.tail.prev = self.tail, self.head
        self.n = 0
        for b in blocks:
            self.append(b)

    def append(self, b: Block):
        last = self.tail.prev
        last.next, b.prev, b.next, self.tail.prev = b, last, self.tail, b
        self.n += 1

    def remove(self, b: Block):
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.n -= 1

    def popleft(self) -> Block:
        if self.n == 0:
            raise RuntimeError("no free KV blocks")
        b = self.head.next
        self.remove(b)
        return b

    def ids(self) -> list[int]:
        out, b = [], self.head.next
        while b is not self.tail:
            out.append(b.id)
            b = b.next
        return out

    def __len__(self):
        return self.n


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(",".join(map(str, token_ids)).encode())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed
        self.free = FreeQueue(self.blocks[1:])
        self.cached: dict[bytes, Block] = {}
        self.enable_caching = enable_caching
        # stats
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        total = len(self.blocks) - 1
        return (total - self.num_free) / total

    def allocate(self, n: int) -> list[Block]:
        if n > self.num_free:
            raise RuntimeError(f"need {n} KV blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            b = self.free.popleft()
            if b.hash is not None:  # evict from the prefix cache
                if self.cached.get(b.hash) is b:
                    del self.cached[b.hash]
                b.hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def touch(self, blocks: Iterable[Block]):
        """Take a reference on cache-hit blocks (pulling free ones out of the queue)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free.remove(b)
            b.ref_cnt += 1

    def release(self, blocks: Iterable[Block]):
        """Drop one reference per block, in the given order; blocks reaching 0 join the queue tail."""
        for b in blocks:
            if b is self.null_block:
                continue
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, b
            if b.ref_cnt == 0:
                self.free.append(b)

    def lookup(self, h: bytes) -> Block | None:
        return self.cached.get(h) if self.enable_caching else None

    def register(self, b: Block, h: bytes):
        if not self.enable_caching or b.hash is not None:
            return
        b.hash = h
        self.cached.setdefault(h, b)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (only when no block is in use, like vLLM)."""
        if self.num_free != len(self.blocks) - 1:
            return False
        for b in self.blocks[1:]:
            b.hash = None
        self.cached.clear()
        return True

    def invalidate_prefix_cache(self):
        """Forget every cached hash, also of blocks in use (new weights make every cached KV block
        stale): running requests keep their blocks, but no later request can hit them."""
        for b in self.blocks[1:]:
            b.hash = None
        self.cached.clear()


class KVCacheManager:
    """Per-request block tables on top of a BlockPool, with prefix caching.

    A request object needs: `request_id`, `all_token_ids` (list), `num_computed_tokens`,
    and gets `block_hashes` (list[bytes]) maintained here."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tables: dict[str, list[Block]] = {}
        self.ids: dict[str, list[int]] = {}  # the tables' block ids (block_ids is asked every step)
        self.num_cached: dict[str, int] = {}  # leading blocks of a table already registered

    # -- prefix cache ----------------------------------------------------------------------
    def _hashes(self, req, upto_blocks: int) -> list[bytes]:
        hs = req.block_hashes
        bs = self.block_size
        toks = req.all_token_ids
        while len(hs) < upto_blocks:
            i = len(hs)
            hs.append(hash_block(hs[-1] if hs else getattr(req, "cache_salt", None), toks[i * bs:(i + 1) * bs]))
        return hs[:upto_blocks]

    def get_computed_blocks(self, req, max_tokens: int | None = None) -> tuple[list[Block], int]:
        """Longest run of cached full blocks at the start of the request's tokens, covering at
        most `max_tokens` tokens (default: all but the last; at least one token is always left to
        compute, its logits are needed). A request whose positions must all be computed (prompt
        logprobs owed) passes its limit (`Request.max_prefix_hit_tokens`)."""
        if max_tokens is None:
            max_tokens = len(req.all_token_ids) - 1
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        max_tokens = min(max_tokens, len(req.all_token_ids) - 1)
        if not self.pool.enable_caching:
            return [], 0
        max_blocks = max_tokens // self.block_size
        hits = []
        for h in self._hashes(req, max_blocks):
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        self.pool.prefix_queries += len(req.all_token_ids)
        self.pool.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    # -- allocation ------------------------------------------------------------------------
    def blocks_needed(self, req, num_new_tokens: int, computed: Sequence[Block] = ()) -> int:
        """Blocks to allocate so that computed tokens, prefix hits and `num_new_tokens` fit."""
        have = len(self.tables.get(req.request_id, ())) + len(computed)
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - have)

    def allocate_slots(self, req, num_new_tokens: int, computed: Sequence[Block] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones. Returns False (and
        changes nothing) when the pool is short; `computed` are prefix hits for a new request."""
        need = self.blocks_needed(req, num_new_tokens, computed)
        if need == 0 and not computed:  # most decode steps: the last block has room
            return True
        # hits that are currently free leave the free queue when touched
        free_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if need > self.pool.num_free - free_hits:
            return False
        table = self.tables.setdefault(req.request_id, [])
        ids = self.ids.setdefault(req.request_id, [])
        if computed:
            self.pool.touch(computed)
            table.extend(computed)
            ids.extend(b.id for b in computed)
        new = self.pool.allocate(need)
        table.extend(new)
        ids.extend(b.id for b in new)
        return True

    def cache_full_blocks(self, req, num_tokens: int):
        """Register the hashes of blocks made full by the first `num_tokens` computed tokens."""
        if not self.pool.enable_caching:
            return
        table = self.tables.get(req.request_id, [])
        n_full = min(num_tokens // self.block_size, len(table))
        done = self.num_cached.get(req.request_id, 0)
        if n_full <= done:  # incremental: a table only grows while its request holds it
            return
        hashes = self._hashes(req, n_full)
        for i in range(done, n_full):
            self.pool.register(table[i], hashes[i])
        self.num_cached[req.request_id] = n_full

    def trim(self, req, num_tokens: int):
        """Give back the tail blocks that hold none of the request's first `num_tokens` tokens
        (speculative decoding: slots of rejected draft tokens). Never touches a registered block:
        only full blocks of computed tokens are registered, and those hold kept tokens."""
        table = self.tables.get(req.request_id)
        if not table:
            return
        keep = -(-num_tokens // self.block_size)
        if keep < self.num_cached.get(req.request_id, 0):
            raise RuntimeError(f"request {req.request_id}: trimming to {num_tokens} tokens would drop cached blocks")
        if keep < len(table):
            tail = table[keep:]
            del table[keep:]
            del self.ids[req.request_id][keep:]
            self.pool.release(reversed(tail))

    def free(self, req):
        table = self.tables.pop(req.request_id, None)
        self.ids.pop(req.request_id, None)
        self.num_cached.pop(req.request_id, None)
        if table:
            self.pool.release(reversed(table))

    def block_ids(self, req) -> list[int]:
        return list(self.ids.get(req.request_id, ()))

    def hit_rate(self) -> float:
        p = self.pool
        return p.prefix_hits / p.prefix_queries if p.prefix_queries else 0.0
