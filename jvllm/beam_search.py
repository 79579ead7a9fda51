"""Beam search on top of the engine's generate with logprobs, as vLLM's `LLM.beam_search` does.

Each step runs every live beam as a one-token request (`max_tokens=1`, `logprobs=2 * beam_width`):
the beam's tokens are its prompt, so the prefix cache hands each beam the full blocks its parent
computed (beams share their common prefix's blocks; each step computes at most a block's worth of
tokens per beam). Each beam's candidates are its top 2 * beam_width next tokens (plus the sampled one
when temperature > 0). Candidates ending in an EOS id (the model's, unless ignore_eos) are finished;
of the others the beam_width best by score stay live. After max_tokens steps (or when no beam is
live) the finished and live beams are ranked by score and the best beam_width returned.

Score (vLLM's `get_beam_search_score`): cumulative logprob / length ** length_penalty, the length
counting the prompt and the generated tokens but not a final EOS. Transformers' `num_beams` search
divides by the generated length instead and finishes only EOS candidates in the step's top
beam_width, so with EOS and length_penalty != 0 the two may rank differently; without EOS finishes
(or with length_penalty 0 and `early_stopping="never"`) they return the same beams.

A beam that reaches max_model_len is finished with reason "length" (it cannot be extended).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from jvllm.outputs import Logprob
from jvllm.sampling_params import BeamSearchParams, SamplingParams


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's then the generated ones (as in vLLM), `logprobs` one
    candidate dict per generated token, `text` the decoded tokens (set on the returned beams)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    num_prompt_tokens: int = 0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) | "length" (max_tokens or max_model_len)
    stop_reason: int | None = None    # the EOS id that finished it

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclasses.dataclass
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(tokens: Sequence[int], cum_logprob: float, eos_token_ids, length_penalty: float) -> float:
    """vLLM's ranking score: cum_logprob / len ** length_penalty, a final EOS not counted."""
    n = len(tokens)
    if n and tokens[-1] in eos_token_ids:
        n -= 1
    return cum_logprob / (max(n, 1) ** length_penalty)


class BeamSearchInstance:
    """The live and finished beams of one prompt."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids, max_model_len: int):
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.max_model_len = max_model_len
        n = len(prompt_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_token_ids), [], 0.0, n)]
        self.completed: list[BeamSearchSequence] = []

    def key(self, b: BeamSearchSequence) -> float:
        return beam_score(b.tokens, b.cum_logprob, self.eos, self.params.length_penalty)

    def advance(self, candidates: list[dict[int, Logprob]]):
        """One step: `candidates[i]` is beam i's {token id: Logprob} of next tokens."""
        if len(candidates) != len(self.beams):
            raise ValueError(f"got candidates for {len(candidates)} beams, {len(self.beams)} are live")
        live = []
        for beam, cands in zip(self.beams, candidates):
            for tok, lp in cands.items():
                new = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [cands], beam.cum_logprob + lp.logprob,
                                         beam.num_prompt_tokens)
                if tok in self.eos:
                    new.finish_reason, new.stop_reason = "stop", tok
                    self.completed.append(new)
                else:
                    live.append(new)
        live.sort(key=self.key, reverse=True)
        self.beams = live[:self.params.beam_width]
        # a beam at max_model_len cannot take another token: it is finished
        full = [b for b in self.beams if len(b.tokens) >= self.max_model_len]
        for b in full:
            b.finish_reason = "length"
            self.completed.append(b)
        self.beams = [b for b in self.beams if len(b.tokens) < self.max_model_len]

    def result(self, tokenizer) -> BeamSearchOutput:
        for b in self.beams:
            b.finish_reason = "length"
        best = sorted(self.completed + self.beams, key=self.key, reverse=True)[:self.params.beam_width]
        for b in best:
            if tokenizer is not None:
                keep = b.tokens
                if b.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                    keep = keep[:-1]
                b.text = tokenizer.decode(keep)
        return BeamSearchOutput(best)


def beam_search(llm, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """Run beam search for each prompt (a string, a token-id list or a prompt dict) on `llm`
    (a `jvllm.LLM`); outputs in input order. All prompts' live beams run in one batch per step."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        return []
    eng = llm.llm_engine
    eos = tuple(eng.eos_token_ids)
    L = eng.sched_config.max_model_len
    sp = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width, ignore_eos=True)
    # the first step runs the prompts as given, so the engine tokenizes and validates them
    first = llm.generate(prompts, sp, use_tqdm=False)
    instances = [BeamSearchInstance(o.prompt_token_ids, params, eos, L) for o in first]
    for inst, out in zip(instances, first):
        inst.advance([out.outputs[0].logprobs[0]])
    steps = range(params.max_tokens - 1)
    if use_tqdm:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="Beam search", unit="token")
    for _ in steps:
        beams = [(inst, b) for inst in instances for b in inst.beams]
        if not beams:
            break
        outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b in beams], sp, use_tqdm=False)
        per: dict[int, list] = {id(inst): [] for inst in instances}
        for (inst, _), out in zip(beams, outs):
            per[id(inst)].append(out.outputs[0].logprobs[0])
        for inst in instances:
            if inst.beams:
                inst.advance(per[id(inst)])
    tok = llm.get_tokenizer()
    return [inst.result(tok) for inst in instances]
