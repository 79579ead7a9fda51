"""Pipeline stages over processes (one process per stage's devices, `jvllm launch`): each process
launches only its own stages; hidden states and the sampled ids cross between processes through
collective-permute programs ("hop", and "swap" for two stages) that both ends' processes call, in
the same order (multi-controller JAX).

A micro-batch's sampled ids cross from the last stage's process to the first's by a hop issued
later (`_flush`): right after the next micro-batch's stage 0 is queued, so the first stage's devices
are not held in a collective while the last stage still computes. On 2 stages the order per step
(micro-batches a, b) is then GPU 0: s0(a), send h(a), s0(b), send h(b), receive ids(a); GPU 1:
receive h(a), s1(a), sample(a), receive h(b), send ids(a), s1(b), ... With two stages both
hand-offs of a step go in one "swap" program. Every process issues the same hops in the same order;
`Pending.result()` issues any still due.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jvllm.compilation.registry import ProgramKind, Signature, register
from jvllm.worker.executors.base import Executor, MicrobatchResult, Pending, Work
from jvllm.worker.programs import cached

HOP = PartitionSpec("hop")


def hop_mesh(ctx, src: int, dst: int) -> Mesh:
    """A ("hop", "tensor") mesh whose row 0 is stage `src`'s devices and row 1 stage `dst`'s."""
    def build():
        devs = np.stack([np.asarray(ctx.stages[src].mesh.devices).reshape(-1),
                         np.asarray(ctx.stages[dst].mesh.devices).reshape(-1)])
        return Mesh(devs, ("hop", "tensor"))

    return cached(ctx, ("hop_mesh", src, dst), build)


def _hop_signature(ctx, key) -> Signature:
    src, dst, shape, dtype = key
    mesh2 = hop_mesh(ctx, src, dst)
    fn = cached(ctx, ("hop", src, dst), lambda: jax.jit(jax.shard_map(
        lambda a: jax.lax.ppermute(a, "hop", [(0, 1)]), mesh=mesh2, in_specs=HOP, out_specs=HOP)))
    arg = jax.ShapeDtypeStruct((2 * shape[0], *shape[1:]), jnp.dtype(dtype), sharding=NamedSharding(mesh2, HOP))
    return Signature(fn, (arg,), tuple(mesh2.devices.flat))


def _swap_signature(ctx, key) -> Signature:
    """Both hand-offs of a 2-stage step in one program: stage 0's hidden states to stage 1 and
    stage 1's sampled ids to stage 0 (each hop launch costs the host an execute call)."""
    shape, dtype = key
    mesh2 = hop_mesh(ctx, 0, 1)
    fn = cached(ctx, "swap", lambda: jax.jit(jax.shard_map(
        lambda h, ids: (jax.lax.ppermute(h, "hop", [(0, 1)]), jax.lax.ppermute(ids, "hop", [(1, 0)])),
        mesh=mesh2, in_specs=(HOP, HOP), out_specs=(HOP, HOP))))
    hop = NamedSharding(mesh2, HOP)
    return Signature(fn, (jax.ShapeDtypeStruct((2 * shape[0], *shape[1:]), jnp.dtype(dtype), sharding=hop),
                          jax.ShapeDtypeStruct((2 * ctx.max_num_seqs,), jnp.int32, sharding=hop)),
                     tuple(mesh2.devices.flat))


def _hop_keys(ctx) -> list:
    """Hops exist only with stages over processes (in one process stage outputs move by device_put)."""
    if not ctx.multiprocess:
        return []
    n, hidden = len(ctx.stages), (ctx.cfg.hidden_size,)
    out = [(s - 1, s, (T, *hidden), str(ctx.dtype)) for T in ctx.layout.token_buckets for s in range(1, n)]
    return out + [(n - 1, 0, (ctx.max_num_seqs,), "int32")]  # sampled ids -> first stage


register(ProgramKind("hop", _hop_signature, _hop_keys, owned=lambda ctx, key: ctx.local(key[0]) or ctx.local(key[1])))
register(ProgramKind("swap", _swap_signature,
                     lambda ctx: [((T, ctx.cfg.hidden_size), str(ctx.dtype)) for T in ctx.layout.token_buckets]
                     if ctx.multiprocess and len(ctx.stages) == 2 else [],
                     owned=lambda ctx, key: ctx.local(0) or ctx.local(1)))


@dataclasses.dataclass
class _Due:
    pending: Pending
    own: object            # the sampled ids padded, on the last stage (None outside its process)


class MultiprocessExecutor(Executor):
    late_sampling = False  # a micro-batch's hand-offs are issued with its sampler: whole launches only

    def __init__(self, runner):
        super().__init__(runner)
        self._due: list[_Due] = []
        self._fillers: dict = {}   # (src, dst, shape, dtype) -> dst-half buffers of a hop's input
        self._stage_devs = [frozenset(st.mesh.devices.flat) for st in runner.stages]
        self.num_swaps = 0

    def prev_ids(self, pending: Pending):
        return pending  # its ids may still be due to cross processes: resolved at launch

    def release(self):
        self._fillers.clear()

    def launch(self, w: Work) -> Pending:
        r = self.r
        n = len(r.stages)
        if isinstance(w.tok_in, Pending):  # every process hands the input ids over now
            ids = w.tok_in.result().tok_pad
            w.tok_in = ids if r.local(0) else r.no_prev
        out = None
        shape_h = (w.T, r.cfg.hidden_size)
        for s_idx in range(n):
            if r.local(s_idx):
                out = self.launch_stage(s_idx, w, w.tok_in if s_idx == 0 else w.x)
            if n == 2 and s_idx == 0 and self._due:
                # both hand-offs in one program: this micro-batch's hidden states to stage 1, the
                # oldest due micro-batch's ids to stage 0
                e = self._due.pop(0)
                t = time.perf_counter()
                h1, ids0 = self._swap(w.x if r.local(0) else None, e.own, shape_h)
                r.timers["sample_call_s"] += time.perf_counter() - t
                w.x = h1
                tok = e.own if r.local(1) else ids0
                e.pending.value = MicrobatchResult(e.pending.group, tok, None, None, tok)
                self._flush()  # any older ones still due (none in the steady state)
                continue
            if s_idx < n - 1 and (r.local(s_idx) or r.local(s_idx + 1)):
                w.x = self._hop(w.x if r.local(s_idx) else None, s_idx, s_idx + 1, shape_h, r.dtype)
            if s_idx == 0:  # stage 0 of this micro-batch is queued: earlier micro-batches' ids may cross
                self._flush()
        own = self.launch_sample(w, out).tok_pad if r.local(n - 1) else None
        p = Pending(w.group, resolve=self._flush)
        self._due.append(_Due(p, own))
        return p

    def _flush(self):
        """Hand every due micro-batch's sampled ids from the last stage's process to the first
        stage's, oldest first (all processes call this at the same points)."""
        r = self.r
        n = len(r.stages)
        while self._due:
            e = self._due.pop(0)
            t = time.perf_counter()
            moved = None
            if r.local(n - 1) or r.local(0):
                moved = self._hop(e.own, n - 1, 0, (r.max_num_seqs,), jnp.int32)
            r.timers["sample_call_s"] += time.perf_counter() - t
            tok = e.own if r.local(n - 1) else moved
            e.pending.value = MicrobatchResult(e.pending.group, tok, None, None, tok)

    def _hop(self, x, src: int, dst: int, shape, dtype):
        """`x` on stage `src`'s devices (in src's process; None elsewhere) -> the same values on
        stage `dst`'s (in dst's process; None elsewhere). Both ends' processes call it."""
        shape, dtype = tuple(shape), str(jnp.dtype(dtype))
        sharding = NamedSharding(hop_mesh(self.r, src, dst), HOP)
        g = self._hop_input(x, src, dst, shape, dtype, sharding)
        return self._hop_output(self.r.programs.get("hop", (src, dst, shape, dtype))(g), dst, shape)

    def _swap(self, h, ids, shape_h):
        r = self.r
        hop = NamedSharding(hop_mesh(r, 0, 1), HOP)
        g_h = self._hop_input(h, 0, 1, shape_h, r.dtype, hop)
        g_i = self._hop_input(ids, 1, 0, (r.max_num_seqs,), jnp.int32, hop)
        out_h, out_i = r.programs.get("swap", (shape_h, str(r.dtype)))(g_h, g_i)
        self.num_swaps += 1
        return self._hop_output(out_h, 1, shape_h), self._hop_output(out_i, 0, (r.max_num_seqs,))

    def _hop_output(self, out, dst: int, shape):
        """The half of a hop program's output on stage `dst`'s devices as that stage's array
        (in dst's process; None elsewhere)."""
        if not self.r.local(dst):
            return None
        devs = self._stage_devs[dst]
        return jax.make_array_from_single_device_arrays(
            tuple(shape), self.r.stages[dst].sharding(), [sh.data for sh in out.addressable_shards if sh.device in devs])

    def _hop_input(self, x, src: int, dst: int, shape, dtype, sharding):
        """The [2 * n, ...] input of a hop from `src` to `dst`: this process's pieces, `x`'s shards on
        src's devices and never-read fillers (allocated once per shape) on dst's."""
        r = self.r
        mine = []
        if r.local(src):
            if x is None or not x.sharding.is_fully_replicated:
                raise ValueError(f"hand-off from stage {src}: needs the stage's output replicated on its devices")
            mine += [sh.data for sh in x.addressable_shards]
        if r.local(dst):
            key = (src, dst, tuple(shape), str(jnp.dtype(dtype)))
            if key not in self._fillers:
                filler = jax.device_put(np.zeros(shape, dtype), r.stages[dst].sharding())
                self._fillers[key] = [sh.data for sh in filler.addressable_shards]
            mine += self._fillers[key]
        return jax.make_array_from_single_device_arrays((2 * shape[0], *shape[1:]), sharding, mine)
