"""How a stage's parameters travel to its step program: fewer, larger arrays.

Calling an executable costs host time per argument array (the dispatch checks each one's type
and sharding, the runtime takes a hold on and records a use of each buffer), not per byte. A
model's tree has many tiny leaves (norm scales: two per layer for Llama, six for Gemma 3; with
quantized weights, one per-channel scale per projection: seven per layer), so `ParamPack.plan`
concatenates every such leaf (`packable`: a 1-D leaf whose path names a norm, or a quantized
projection's scale `*_proj_scale` of at most `MAX_PACKED` elements) that is fully replicated and
fully addressable into one flat array per (dtype, sharding), once; the program slices them back
(`unpack`, static slices of a parameter that fuse into their consumers' elementwise code: no copy,
the same values). Everything else travels as it is: matrices, sharded vectors (tensor-parallel
scales), large group scales, and the other 1-D leaves (biases).

Contract: `pack(leaves)` gives the program's argument list (big leaves in tree order, then one
array per group); `unpack(args)` inside the program gives the leaves in tree order again.
Hazard: the packed arrays are copies, so a stage whose leaves change (a weight update) must pack
again (`Stage.params` re-packs when its leaf list is replaced).
"""
from __future__ import annotations

import dataclasses

import numpy as np

MAX_PACKED = 1 << 16  # elements: a larger scale (groups of a big projection) travels as it is


def packable(name: str, a) -> bool:
    """Whether the leaf `a` at path `name` is one of the small leaves `ParamPack` packs: a norm's
    1-D scale, or a quantized projection's scale (`*_proj_scale`) of at most MAX_PACKED elements."""
    n = name.lower()
    ndim = getattr(a, "ndim", None)
    return ((ndim == 1 and "norm" in n) or (ndim is not None and "proj_scale" in n
                                            and int(np.prod(a.shape)) <= MAX_PACKED))


@dataclasses.dataclass(frozen=True)
class PackedGroup:
    dtype: str                                   # numpy dtype name of every member
    members: tuple[tuple[int, int, tuple], ...]  # (leaf index, offset, shape) in the flat array
    size: int                                    # elements of the flat array


@dataclasses.dataclass(frozen=True)
class ParamPack:
    num_leaves: int
    big: tuple[int, ...]              # leaf indices passed as they are, in order
    groups: tuple[PackedGroup, ...]   # one flat array per (dtype, sharding), after the big leaves

    @staticmethod
    def plan(leaves, names) -> "ParamPack":
        """Group the `packable` leaves among `leaves` (`names`: each leaf's path, e.g. from
        `jax.tree_util.keystr`) that are fully replicated and fully addressable by (dtype,
        sharding) (a group of one leaf is not worth a copy and stays as it is)."""
        if len(names) != len(leaves):
            raise ValueError(f"param pack: {len(names)} names for {len(leaves)} leaves")
        by_key: dict[tuple, list[int]] = {}  # (dtype, sharding) -> leaf indices
        for i, (a, name) in enumerate(zip(leaves, names)):
            sh = getattr(a, "sharding", None)
            if (packable(name, a) and sh is not None and sh.is_fully_replicated
                    and getattr(a, "is_fully_addressable", False)):
                by_key.setdefault((np.dtype(a.dtype).name, sh), []).append(i)
        groups, packed = [], set()
        for (dt, _), idx in by_key.items():
            if len(idx) < 2:
                continue
            members, off = [], 0
            for i in idx:
                members.append((i, off, tuple(leaves[i].shape)))
                off += int(leaves[i].size)
            groups.append(PackedGroup(dt, tuple(members), off))
            packed.update(idx)
        big = tuple(i for i in range(len(leaves)) if i not in packed)
        return ParamPack(len(leaves), big, tuple(groups))

    @property
    def num_args(self) -> int:
        return len(self.big) + len(self.groups)

    def pack(self, leaves) -> list:
        """The program's argument list from the stage's leaves (device arrays; each group's flat
        array is built on the host and placed with its members' sharding)."""
        import jax

        if len(leaves) != self.num_leaves:
            raise ValueError(f"param pack: {len(leaves)} leaves, planned for {self.num_leaves}")
        out = [leaves[i] for i in self.big]
        for g in self.groups:
            first = leaves[g.members[0][0]]
            flat = np.concatenate([np.asarray(leaves[i]).reshape(-1) for i, _, _ in g.members])
            if flat.dtype.name != g.dtype or flat.size != g.size:
                raise ValueError(f"param pack: group {g.dtype} of {g.size} elements got {flat.dtype} x {flat.size}")
            out.append(jax.device_put(flat, first.sharding))
        return out

    def unpack(self, args) -> list:
        """The leaves in tree order from `pack`'s list (inside the program: static slices)."""
        if len(args) != self.num_args:
            raise ValueError(f"param pack: {len(args)} arguments, expected {self.num_args}")
        leaves = [None] * self.num_leaves
        for i, a in zip(self.big, args):
            leaves[i] = a
        for g, flat in zip(self.groups, args[len(self.big):]):
            for i, off, shape in g.members:
                n = int(np.prod(shape))
                leaves[i] = flat[off:off + n].reshape(shape)
        return leaves
