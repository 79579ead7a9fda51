"""The offline workloads of BENCHMARKS.md as data: what W1 / B1 / P1 are, their prompts and their
sampling. Nothing here touches a device.

    W1 throughput  N requests at t=0, W1 prompts (numpy default_rng(0)), output-len tokens each,
                   greedy, EOS ignored. Figure: output tokens/s from first submission to last token.
    B1 latency     one prompt of input-len tokens, output-len tokens. Figures: tokens/s, ms per
                   decode step, MBU.
    P1 prefill     one prompt of input-len tokens, max_tokens=1. Figures: tokens/s and MFU.
"""
from __future__ import annotations

import argparse
import dataclasses

W1_INPUT_LEN = (64, 1024)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One `jvllm bench` subcommand: its name, the figure it produces and its CLI defaults.
    `input_len` is a (lo, hi) range for W1 and one length for B1 / P1."""
    name: str
    figure: str
    help: str
    input_len: int | tuple[int, int]
    output_len: int


WORKLOADS = (
    Workload("throughput", "W1", "W1: N requests at t=0, output tokens/s", W1_INPUT_LEN, 256),
    Workload("latency", "B1", "B1: one prompt, decode tokens/s, ms/step, MBU", 512, 256),
    Workload("prefill", "P1", "P1: one long prompt, prefill tokens/s, MFU", 2048, 1),
)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The sampling every request of a run uses. W1 / B1 are greedy by definition; --temperature /
    --top-p / --top-k / --min-p run the same workloads through the general sampler program instead of the
    argmax-only one. EOS is always ignored, so every request produces exactly max_tokens."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0

    def params(self, max_tokens: int):
        from jvllm import SamplingParams

        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **dataclasses.asdict(self))


GREEDY = Sampling()


def sampling_params(max_tokens: int, sampling: Sampling = GREEDY):
    """SamplingParams for one benchmark request: `max_tokens` tokens, EOS ignored."""
    return sampling.params(max_tokens)


def w1_prompts(n: int, input_len: tuple[int, int] = W1_INPUT_LEN, vocab: int = 128256, seed: int = 0) -> list[list[int]]:
    """W1 prompts: `rng = default_rng(seed); lens = rng.integers(lo, hi + 1, n)`, then per length
    `rng.integers(100, 128000, l)`. Ids >= vocab are taken mod vocab (small-vocab models) so the
    prompts stay distinct: clipping would turn them into runs of one id that the prefix cache shares."""
    import numpy as np

    lo, hi = input_len
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, n)
    out = []
    for length in lens:
        ids = rng.integers(100, 128000, int(length))
        if vocab < 128000:
            ids = ids % vocab
        out.append(ids.tolist())
    return out


def one_prompt(length: int, vocab: int, seed: int) -> list[int]:
    """One W1-style prompt of exactly `length` tokens (B1, P1, the first-token probe)."""
    return w1_prompts(1, (length, length), vocab, seed)[0]


def cap_input_len(input_len: tuple[int, int], output_len: int, max_model_len: int) -> tuple[tuple[int, int], str | None]:
    """W1's prompt length range cut so that a prompt and its `output_len` tokens fit in
    `max_model_len` (a short-context model), and the line that says so (None when nothing was cut).
    Raises ValueError when `output_len` alone leaves no room for a prompt of one token."""
    lo, hi = input_len
    room = max_model_len - output_len
    if room < 1:
        raise ValueError(f"--output-len {output_len} leaves no room for a prompt: max_model_len is {max_model_len}; "
                         f"lower --output-len below {max_model_len}")
    if hi <= room:
        return (lo, hi), None
    capped = (min(lo, room), room)
    return capped, (f"W1: prompt lengths {lo}..{hi} capped to {capped[0]}..{capped[1]} so that prompt + "
                    f"{output_len} output tokens fit max_model_len {max_model_len}")


def parse_len_range(s: str) -> tuple[int, int]:
    """`LO,HI` (or `LO:HI`, or one `N` meaning N,N) as an argparse type."""
    try:
        parts = [int(x) for x in str(s).replace(":", ",").split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-len wants LO,HI with 1 <= LO <= HI, got {s!r}") from None
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or parts[0] > parts[1] or parts[0] < 1:
        raise argparse.ArgumentTypeError(f"--input-len wants LO,HI with 1 <= LO <= HI, got {s!r}")
    return parts[0], parts[1]
