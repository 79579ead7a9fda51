"""How a step splits into pipeline micro-batches (one group without pipeline stages)."""
from __future__ import annotations

import numpy as np


def split(scheduled, num_microbatches: int, num_stages: int, prev_groups=None) -> list[tuple[list, int | None]]:
    """Split a step into up to `num_microbatches` groups of (index, ScheduledRequest): the
    scheduler's micro-batches (`Request.microbatch`, engine runs), else balanced by tokens
    (several pipeline stages; one group otherwise). Returns [(group, p)] where p is the index of
    the group of `prev_groups` (the step still in flight: its Pendings) whose sampled ids this
    group's pending tokens come from, or None.

    With a step in flight (async scheduling) groups are stable: a request that was in group p of
    the previous step stays with the others of group p, so each group's pending tokens sit in one
    device array (that group's sampled ids) and micro-batch g of step N+1 follows micro-batch g of
    step N through the stages, keeping the pipeline full across steps. New requests go to the
    group with the fewest tokens. Raises RuntimeError if a running request changed micro-batch."""
    m = min(num_microbatches, len(scheduled)) if num_stages > 1 else 1
    owner = {} if prev_groups is None else {s.req.request_id: p for p, e in enumerate(prev_groups) for _, s in e.group}
    if m > 1 and all(getattr(s.req, "microbatch", None) is not None for s in scheduled):
        # the scheduler's micro-batches (each within the token budget, members stable while running)
        by: dict[int, list] = {}
        for i, s in enumerate(scheduled):
            by.setdefault(s.req.microbatch, []).append((i, s))
        out = []
        for g in sorted(by):
            ps = {owner[s.req.request_id] for _, s in by[g] if s.req.request_id in owner}
            if len(ps) > 1:
                raise RuntimeError(f"micro-batch {g} draws pending tokens from micro-batches {sorted(ps)} "
                                   "of the step in flight; a request changed micro-batch while running")
            out.append((by[g], ps.pop() if ps else None))
        return out
    if prev_groups is None:
        if m <= 1:
            return [(list(enumerate(scheduled)), None)]
        total = sum(s.num_tokens for s in scheduled)
        groups, cur, acc = [], [], 0
        for i, s in enumerate(scheduled):
            cur.append((i, s))
            acc += s.num_tokens
            if acc >= total * (len(groups) + 1) / m and len(groups) < m - 1:
                groups.append(cur)
                cur = []
        if cur:
            groups.append(cur)
        return [(g, None) for g in groups]
    pinned: dict[int, list] = {}
    free = []
    for i, s in enumerate(scheduled):
        p = owner.get(s.req.request_id)
        (free if p is None else pinned.setdefault(p, [])).append((i, s))
    out = [(g, p) for p, g in sorted(pinned.items())]
    while len(out) < max(m, 1):
        out.append(([], None))
    load = [sum(s.num_tokens for _, s in g) for g, _ in out]
    for item in free:
        k = int(np.argmin(load))
        out[k][0].append(item)
        load[k] += item[1].num_tokens
    return [(sorted(g, key=lambda t: t[0]), p) for g, p in out if g]
