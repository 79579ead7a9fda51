"""What a built engine is, as the figures need it: parameter bytes and counts, KV bytes per token,
and XLA's report on every compiled program."""
from __future__ import annotations

import re
import time


def param_stats(llm) -> dict:
    """Unique parameter arrays of the runner (state leaves + head, tied head counted once). For a
    mixture of experts also `active_weight_bytes` and `active_params`: what one token reads and
    multiplies by (its top_k experts: B1's floor, P1's FLOPs)."""
    import jax

    r = llm.llm_engine.runner
    states = [st.state for st in getattr(r, "stages", None) or []] or [r.state]  # pipeline stages, or one
    seen, nbytes, count = set(), 0, 0
    for a in jax.tree_util.tree_leaves(states) + jax.tree_util.tree_leaves(r.head_w):
        if not hasattr(a, "nbytes") or id(a) in seen:
            continue
        seen.add(id(a))
        nbytes += int(a.nbytes)
        count += int(a.size)
    out = dict(weight_bytes=nbytes, num_params=count)
    mc = getattr(llm.llm_engine, "model_config", None)
    if getattr(mc, "moe", None) is not None:
        m = mc.moe
        sparse = sum(m.is_sparse(i) for i in range(mc.num_layers))
        expert_params = sparse * 3 * mc.hidden_size * m.expert_size * m.num_experts
        experts = expert_params * jax.tree_util.tree_leaves(r.head_w)[0].dtype.itemsize
        out["active_weight_bytes"] = nbytes - experts + experts * m.top_k // m.num_experts
        out["active_params"] = count - expert_params + expert_params * m.top_k // m.num_experts
    return out


def kv_bytes_per_token(llm) -> int:
    """KV bytes of one token over every layer and KV head (memory.kv_cache's one formula)."""
    from jvllm.memory.kv_cache import bytes_per_block

    e = getattr(llm.llm_engine, "replicas", [llm.llm_engine])[0]
    return bytes_per_block(e.model_config, e.worker.kv_dtype, 1)


def prog_name(kind, key) -> str:
    """A program's readable name in the JSON, e.g. `step[T=64]`, `sample[R=8,greedy]`."""
    if kind in ("sample", "sample_procs") and isinstance(key, tuple) and len(key) == 2:  # (R, SamplerVariant)
        return f"{kind}[R={key[0]},{key[1]!r}]"
    if kind == "greedy":
        return f"sample[R={key},greedy]"
    if kind == "step" and isinstance(key, tuple) and len(key) == 3:  # (pipeline stage, T, decode-only)
        return f"step[stage={key[0]},T={key[1]}{',decode' if key[2] else ''}]"
    return f"{kind}[T={key}]" if isinstance(key, int) else f"{kind}{list(key) if isinstance(key, tuple) else [key]}"


_FUSION_OP = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*.*?\bfusion\(", re.MULTILINE)


def fusion_ops(exe) -> int | None:
    """Fusion instructions in the optimized HLO (`%x = ... fusion(...)`, any backend's naming);
    None where the executable gives no HLO text."""
    try:
        return len(_FUSION_OP.findall(exe.as_text()))
    except Exception:
        return None


def xla_report(llm) -> dict:
    """jvllm.compilation.program_report for every compiled program (plus `fusion_ops`, counted here
    from the HLO text by op rather than by name), and per-kind maxima."""
    from jvllm.compilation import program_report

    progs, summary = {}, {}
    t0 = time.perf_counter()
    e0 = getattr(llm.llm_engine, "replicas", [llm.llm_engine])[0]
    for (kind, key), exe in sorted(e0.worker.compiled_programs().items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        rep = program_report(exe)
        rep["fusion_ops"] = fusion_ops(exe)
        progs[prog_name(kind, key)] = rep
        s = summary.setdefault(kind, dict(programs=0))
        s["programs"] += 1
        for f in ("fusions", "fusion_ops", "hlo_instructions", "flops", "bytes_accessed"):
            if rep.get(f) is not None:
                s[f"max_{f}"] = max(s.get(f"max_{f}", 0), rep[f])
        if "temp_bytes" in rep:
            s["max_temp_bytes"] = max(s.get("max_temp_bytes", 0), rep["temp_bytes"])
    return dict(summary=summary, programs=progs, report_seconds=time.perf_counter() - t0)
