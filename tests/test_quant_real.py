"""Quantized weights on real models, teacher-forced: the top-1 next-token agreement with the
unquantized (float32) model over a few hundred positions of English text, and the largest
difference of the actual next token's log-probability (printed; run with -s to see them).

Issue 21's targets: SmolLM2 135M (fragile: a per-channel torch reference agrees 92% for fp8
weights, 97.7% for int8) >= 90% for fp8 and >= 96% for int8; Gemma 3 270M >= 98% for every
variant. The default layout (one scale per output channel, jvllm.quantization.config) runs on
SmolLM2 for both methods and on Gemma 3 for fp8; Gemma 3's int8 runs with the opt-in groups of 32
input rows (quantization_group_size=32), which meet its 0.98 (per channel does not). fp8 does NOT
meet 0.98 on Gemma 3 per channel, nor with opt-in groups (e4m3's 3 mantissa bits leave about 2%
RMS weight error whatever the scale), so Gemma 3's fp8 threshold is the measured figure less a
margin, guarding against regressions, not the issue's target. Measured figures:
benchmarks/README.md. The opt-in W8A8 path and the group-scaled fp8 engine are tested on a tiny
model in test_quant_engine.py.
Each model is read from its GGUF once (an Orbax copy serves the other engines)."""
import importlib.util

import numpy as np
import pytest

from tests.helpers import logits_only_llm

TEXT = (
    "The river that runs past the old mill has changed its course three times in living memory. "
    "In the spring of the flood year the water rose over the lower meadow, carried away the footbridge "
    "and left a bank of gravel where the sheep used to graze. The miller's daughter, who kept the "
    "accounts, wrote that the wheel turned faster that week than at any time since her grandfather "
    "built it, and that the grain was ground in half the usual time. When the water fell again, the "
    "village met in the church hall to decide whether to rebuild the bridge in the same place or to "
    "move it upstream, where the banks are higher and the rock is closer to the surface. The engineer "
    "from the county explained that a bridge on rock would last a century, while one on gravel would "
    "need repairs every few years. The farmers on the far side argued that the longer road would cost "
    "them an hour each day at harvest. In the end they voted to build on the rock, and the children "
    "were given a holiday to watch the first stones being laid. Today the old crossing is marked only "
    "by two posts in the grass, and most people who walk along the river do not know that a bridge "
    "ever stood there. The mill still turns on summer weekends for visitors, who buy small bags of "
    "flour and ask why the wheel sits so far from the water. The answer is written in the accounts."
)
# model -> method -> (quantization_group_size, threshold)
MODELS = {"smollm2": {"fp8": ("auto", 0.90), "int8": ("auto", 0.96)},
          "gemma3": {"fp8": ("auto", 0.92), "int8": (32, 0.98)}}
KW = dict(dtype="float32", max_model_len=512, max_num_seqs=2, max_num_batched_tokens=64, token_buckets=(64,),
          use_tqdm_on_load=False, background_compile=False)


def _available(name):
    from jvllm.converters import BUILTIN_MODELS

    return importlib.util.find_spec(BUILTIN_MODELS[name].package) is not None


def _run(model, quantization, ids=None, group_size="auto"):
    kw = dict(KW, quantization_group_size=group_size) if quantization else KW
    llm = logits_only_llm(model, quantization=quantization, **kw)
    try:
        if ids is None:
            ids = llm.get_tokenizer().encode(TEXT)
        return ids, llm.llm_engine.runner.sequence_logits(ids), llm.llm_engine.model_config.quant
    finally:
        llm.shutdown()


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.fixture(scope="module", params=list(MODELS))
def reference(request, tmp_path_factory):
    from jvllm.converters import convert_to_orbax

    if not _available(request.param):
        pytest.skip(f"built-in model {request.param!r} is not installed")
    path = str(tmp_path_factory.mktemp(request.param) / "orbax")
    convert_to_orbax(request.param, path, dtype="float32")
    ids, z, _ = _run(path, None)
    assert len(ids) >= 250, len(ids)
    return request.param, path, ids, _log_softmax(z[:-1])


@pytest.mark.parametrize("q", ["fp8", "int8"])
def test_teacher_forced_top1_agreement(reference, q):
    model, path, ids, ref = reference
    group, threshold = MODELS[model][q]
    _, z, quant = _run(path, q, ids, group)
    assert quant.group_size == (None if group == "auto" else group)
    lp = _log_softmax(z[:-1])
    agree = float(np.mean(lp.argmax(-1) == ref.argmax(-1)))
    nxt = np.asarray(ids[1:])
    rows = np.arange(len(nxt))
    dlp = np.abs(lp[rows, nxt] - ref[rows, nxt])
    print(f"\n{model} {q} (group_size {quant.group_size}): top-1 agreement {agree:.1%} over {len(nxt)} positions; next-token logprob "
          f"difference max {dlp.max():.3f}, mean {dlp.mean():.4f}")
    assert agree >= threshold
