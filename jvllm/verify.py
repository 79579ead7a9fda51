"""`jvllm verify MODEL`: compare jvllm against transformers on the same checkpoint file.

Two independent implementations: jvllm's converter + Flax forward (paged attention path) versus
transformers' own loading (`from_pretrained`, `gguf_file=` for GGUF) and PyTorch forward, both in
float32 on the CPU. For each fixed prompt it reports the max |logit difference| over all positions
and the top-1 agreement. It fails when the difference exceeds `atol`, or when the top-1 tokens
differ at a position where transformers' top-1 margin is larger than `atol` (a genuine
disagreement, not a near-tie flip).
"""
from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "Once upon a time, in a small village by the sea, there lived",
    "Translate to German: The weather is nice today.",
)
DEFAULT_ATOL = 1e-3


@dataclasses.dataclass
class PromptReport:
    prompt: str
    num_tokens: int
    max_abs_diff: float
    top1_agreement: float
    hard_disagreements: int

    def ok(self, atol: float) -> bool:
        return self.max_abs_diff <= atol and self.hard_disagreements == 0


def load_reference(spec):
    """transformers' own model for the checkpoint (float32, CPU). MissingDependencyError (one line)
    without torch."""
    from jvllm.converters.deps import require_torch

    torch = require_torch("the transformers reference of `jvllm verify`")
    import transformers

    if spec.kind == "gguf":
        d, f = os.path.split(os.path.abspath(spec.path))
        m = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    elif spec.kind == "hf":
        from jvllm.converters import hf_config_dict
        from jvllm.models.registry import text_only

        arch = (hf_config_dict(spec).get("architectures") or [None])[0]
        # a multimodal wrapper served text-only: its own class (AutoModelForCausalLM knows only some)
        cls = getattr(transformers, arch) if arch and text_only(arch) else transformers.AutoModelForCausalLM
        m = cls.from_pretrained(spec.path, dtype=torch.float32)
    else:
        raise ValueError(f"verify compares against transformers, which cannot read {spec.kind} checkpoints; "
                         f"verify the source checkpoint instead")
    return m.eval()


def fixed_token_prompts(vocab_size: int, n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, int(length)).tolist() for length in rng.integers(5, 40, n)]


def verify(model: str, prompts=None, atol: float = DEFAULT_ATOL, log=print) -> tuple[bool, list[PromptReport]]:
    import jax.numpy as jnp

    from jvllm.config import cdiv
    from jvllm.converters.deps import require_torch
    from jvllm.converters import load_checkpoint, load_tokenizer, resolve_model
    from jvllm.models import bind
    from jvllm.worker.model_runner import ModelRunner

    torch = require_torch("jvllm verify")
    spec = resolve_model(model)
    t0 = time.perf_counter()
    log(f"jvllm: loading {spec.path} ...")
    ck = load_checkpoint(spec, "float32")
    log(f"jvllm: loaded {spec.kind} checkpoint {spec.path} in {ck.load_seconds:.1f}s "
        f"({ck.config.architecture}, {ck.config.num_layers} layers)")
    t1 = time.perf_counter()
    log("transformers: loading the same checkpoint (float32, CPU) ...")
    ref = load_reference(spec)
    log(f"transformers: loaded in {time.perf_counter() - t1:.1f}s")
    tok = load_tokenizer(spec)
    cfg = ck.config
    if prompts is None:
        if tok is not None:
            prompts = [(p, tok(p)["input_ids"]) for p in DEFAULT_PROMPTS]
        else:
            log("no tokenizer files: verifying on fixed token ids")
            prompts = [(f"<{len(ids)} fixed token ids>", ids) for ids in fixed_token_prompts(cfg.vocab_size)]
    else:
        prompts = [(p, tok(p)["input_ids"]) if isinstance(p, str) else (f"<{len(p)} token ids>", list(p))
                   for p in prompts]
    max_len = max(len(ids) for _, ids in prompts)
    graphdef, state = bind(cfg, ck.params, jnp.float32)
    from jvllm.models.layers import head_of

    head = head_of(cfg, ck.params)
    bs = 16
    log(f"jvllm: compiling the forward pass for {max_len} tokens ...")
    runner = ModelRunner(cfg, graphdef, state, head, dtype=jnp.float32, block_size=bs,
                         num_blocks=cdiv(max_len, bs) + 1, max_model_len=max_len, max_num_seqs=1,
                         token_buckets=(max_len,))
    reports = []
    for i, (text, ids) in enumerate(prompts):
        t2 = time.perf_counter()
        ours = runner.sequence_logits(ids)
        t3 = time.perf_counter()
        with torch.no_grad():
            theirs = ref(torch.tensor([ids])).logits[0].float().numpy()
        log(f"prompt {i + 1}/{len(prompts)} ({len(ids)} tokens): jvllm {t3 - t2:.1f}s, "
            f"transformers {time.perf_counter() - t3:.1f}s")
        diff = float(np.max(np.abs(ours - theirs)))
        a, b = ours.argmax(-1), theirs.argmax(-1)
        srt = np.sort(theirs, axis=-1)
        margin = srt[:, -1] - srt[:, -2]
        hard = int(np.sum((a != b) & (margin > atol)))
        reports.append(PromptReport(text, len(ids), diff, float(np.mean(a == b)), hard))
    ok = all(r.ok(atol) for r in reports)
    log(f"{'prompt':<48} {'tokens':>6} {'max|dlogit|':>12} {'top1 agree':>10}")
    for r in reports:
        p = r.prompt.replace("\n", " ")
        log(f"{p[:48]:<48} {r.num_tokens:>6} {r.max_abs_diff:>12.2e} {r.top1_agreement:>10.1%}"
            f"{'' if r.ok(atol) else '  FAIL'}")
    log(f"{'PASS' if ok else 'FAIL'}: tolerance max|dlogit| <= {atol:g} (float32, CPU); "
        f"total {time.perf_counter() - t0:.1f}s")
    return ok, reports
