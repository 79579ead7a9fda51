"""Run a `jvllm` command with other launches for the MoE decode path's two kernels (probes only:
the engine's launches are `jvllm.ops.pallas_moe_decode.GATE_UP` / `DOWN`).

    python benchmarks/probes/moe_decode_launch.py GU/DN bench latency --model random:qwen3-30b-a3b ...

GU and DN are `bn x bk x warps x stages` as in moe_decode_probe.py's --sweep ("default" keeps the
engine's). The override is in place before any program is traced (background compiles included);
give the run its own JVLLM_CACHE_DIR so that no cached program of other launches is loaded.
"""
from __future__ import annotations

import sys


def parse(spec: str):
    """'GU/DN' -> (gate_up Launch, down Launch); 'default' -> the engine's."""
    from jvllm.ops import pallas_moe_decode as dec

    if spec == "default":
        return dec.GATE_UP, dec.DOWN
    try:
        gu, dn = spec.split("/")
        return tuple(dec.Launch(*(int(v) for v in s.split("x"))) for s in (gu, dn))
    except (ValueError, TypeError):  # not two parts, not integers, not four numbers
        raise SystemExit(f"launch {spec!r}: expected 'default' or GU/DN, each bn x bk x warps x stages")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit(__doc__)
    from jvllm.ops import pallas_moe_decode as dec

    gu, dn = parse(argv[0])
    dec.GATE_UP, dec.DOWN = gu, dn
    dec.expert_rows.__kwdefaults__.update(gate_up=gu, down=dn)  # keyword defaults are bound at def time
    from jvllm.cli import main as cli

    return cli(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
