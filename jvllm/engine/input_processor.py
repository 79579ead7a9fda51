"""Input processing: a prompt (text, token ids or a dict) -> validated token ids (the last
`truncate_prompt_tokens` kept) -> the Requests of one user request (best_of, else n, sequences
sharing the prompt; bad_words tokenized once for all of them). Bad input raises before anything is
queued."""
from __future__ import annotations

import numpy as np

from jvllm.bad_words import bad_words_token_ids
from jvllm.engine.request import Request
from jvllm.inputs import check_prompt_dict
from jvllm.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: tuple, seed: int,
                 logprobs_refused: str | None = None, num_layers: int | None = None, num_stages: int = 1,
                 processor_names: tuple[str, ...] = (), hidden_size: int | None = None):
        """`logprobs_refused`: why this engine cannot return logprobs (stages over processes), or None."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.logprobs_refused = logprobs_refused
        self.num_layers, self.num_stages = num_layers, num_stages
        self.processor_names = processor_names
        self.hidden_size = hidden_size
        self._rng = np.random.default_rng(seed)
        self._structured = None  # jvllm.structured.StructuredBackend, built on the first constrained request

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            check_prompt_dict(prompt)  # keys jvllm does not take (multi_modal_data, ...) are errors
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (skip_tokenizer_init): pass "
                                 "{'prompt_token_ids': [...]} instead of text")
            return prompt, list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise TypeError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def process(self, request_id: str, prompt, params: SamplingParams, arrival_time: float | None):
        """(text, token ids, [Request] of the n sequences). Raises ValueError / TypeError."""
        text, ids = self.tokenize(prompt)
        V, L = self.vocab_size, self.max_model_len
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        k = params.truncate_prompt_tokens
        if k is not None:
            if k > L:
                raise ValueError(f"truncate_prompt_tokens {k} is more than max_model_len ({L})")
            ids = ids[-(L - 1 if k == -1 else k):]
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids {bad[:8]} outside the vocabulary [0, {V})")
        if len(ids) >= L:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {L}, which leaves no room "
                             f"to generate")
        params.validate_for_vocab(V)
        if self.num_layers is not None:
            params.validate_for_model(self.num_layers, self.num_stages, self.hidden_size)
        params.validate_processors(self.processor_names)
        bad_ids = None
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer; this model has none (skip_tokenizer_init)")
            bad_ids = bad_words_token_ids(params.bad_words, self.tokenizer, V)
        if self.logprobs_refused and (params.logprobs is not None or params.prompt_logprobs is not None):
            raise ValueError(f"logprobs={params.logprobs}, prompt_logprobs={params.prompt_logprobs}: "
                             f"{self.logprobs_refused}")
        grammar = self._grammar(params)
        seqs = []
        num = params.num_seqs
        for i in range(num):
            if params.seed is not None:
                seed = params.seed if i == 0 else hash((params.seed, i)) & (2**63 - 1)
            else:
                seed = int(self._rng.integers(0, 2**63 - 1))
            rid = request_id if num == 1 else f"{i}_{request_id}"
            seqs.append(Request(rid, ids, params, seed, self.eos_token_ids, text, group_id=request_id, index=i,
                                arrival_time=arrival_time, tokenizer=self.tokenizer if params.detokenize else None,
                                length_cap=L - len(ids), bad_words_ids=bad_ids))
            if grammar is not None:
                seqs[-1].grammar = self._structured.state(grammar)
        return text, ids, seqs

    def use_grammar_tokenizer(self, tokenizer):
        """Compile grammars against `tokenizer` (an HF tokenizer) instead of the engine's: for
        benchmarks of engines without one (random weights). Its ids must lie below the model's
        vocabulary size; ids it lacks are never allowed."""
        from jvllm.structured import StructuredBackend

        self._structured = StructuredBackend(tokenizer, self.vocab_size, self.eos_token_ids)

    def _grammar(self, params: SamplingParams):
        """The compiled grammar of a constrained request (ValueError with the backend's reason), or None."""
        if params.structured_outputs is None:
            return None
        if self._structured is None:
            from jvllm.structured import StructuredBackend

            self._structured = StructuredBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._structured.compile(params.structured_outputs)
