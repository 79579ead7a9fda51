"""One sequence the scheduler runs (a user request with n > 1 becomes n of these), and the
incremental detokenizer. Plain Python: no jax."""
from __future__ import annotations

import enum
import time
import weakref

import numpy as np

from jvllm.outputs import Logprob, RequestMetrics
from jvllm.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self._finished  # set per member below: the engine asks this of every request every step

    @property
    def reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort", 6: "error"}.get(self.value)


for _m in Status:
    _m._finished = _m.value >= 3


_ADDED_TOKENS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def added_token_texts(tokenizer) -> dict[int, str]:
    """{token id: text} of the tokenizer's added tokens (special tokens and the like), read once
    per tokenizer."""
    texts = _ADDED_TOKENS.get(tokenizer)
    if texts is None:
        texts = {int(i): str(getattr(t, "content", t)) for i, t in tokenizer.added_tokens_decoder.items()}
        _ADDED_TOKENS[tokenizer] = texts
    return texts


class Detokenizer:
    """Incremental detokenization that never emits half a multi-byte character.

    Keeps a window [prefix_offset, read_offset) of already-emitted tokens as context (a few prompt
    tokens at the start, so sentencepiece's leading-space rules see the same context as a full
    decode) and emits decode(window + new) minus decode(window), holding back while the decode ends
    in U+FFFD (an incomplete UTF-8 sequence).

    `spaces_between_special_tokens=False` (only meaningful with `skip_special_tokens=False`, as in
    vLLM): an added token that directly follows another added token is emitted as its bare text,
    without the space a tokenizer's decoder (WordPiece, for one) puts between tokens. True keeps
    the tokenizer's own decoding (vLLM's behaviour for fast tokenizers)."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-5:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        # added-token texts when the spaces between them are to go, else None (nothing to do)
        self.added = None
        if not skip_special_tokens and not spaces_between_special_tokens:
            self.added = added_token_texts(tokenizer) or None
        self.last_added = bool(self.ids) and self.added is not None and self.ids[-1] in self.added

    def _decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.added is not None:
            text = self.added.get(token_id)
            after_added, self.last_added = self.last_added, text is not None
            if text is not None and after_added and self.read_offset == len(self.ids) - 1:
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                return text
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 eos_token_ids: tuple = (), prompt: str | None = None, group_id: str | None = None,
                 index: int = 0, arrival_time: float | None = None, tokenizer=None,
                 length_cap: int = 2**31, bad_words_ids: list[list[int]] | None = None):
        """`tokenizer` None: no text (detokenize=False or no tokenizer). `bad_words_ids`: the
        request's bad words as token ids (`bad_words.bad_words_token_ids`)."""
        self.request_id = request_id
        self.group_id = group_id or request_id
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_computed_tokens = 0
        self.num_pending = 0  # tokens sampled by dispatched steps, not yet appended (0, 1 or 2)
        self.microbatch: int | None = None  # pipeline micro-batch, fixed from admission to preemption
        self.length_cap = length_cap  # max_model_len - prompt length
        self.bad_words_ids = bad_words_ids
        self.status = Status.WAITING
        self.block_hashes: list[bytes] = []
        self.cache_salt: bytes | None = params.cache_salt()  # the first block's hash parent
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # outputs
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # prompt logprobs are the prompt's, not a sequence's: of n > 1 siblings only the first
        # computes them (the others take the prompt's blocks from the prefix cache)
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None and index == 0 else None
        self.detok = Detokenizer(tokenizer, self.prompt_token_ids, params.skip_special_tokens,
                                 params.spaces_between_special_tokens) if tokenizer else None
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        # hidden-state chunks [L+1, n, hidden] of positions 0 .. num_hidden-1 (return_hidden_states)
        self.hidden_chunks: list | None = [] if params.return_hidden_states else None
        self.num_hidden = 0
        self.sent_text_len = 0  # for DELTA outputs / streaming
        self.sent_token_len = 0
        self.spec_token_ids: list[int] = []  # speculative decoding: drafts proposed for the next step
        # what those drafts assumed of tokens not known when they were proposed: (number of tokens
        # known then, the ids assumed after them), or None (proposed from known tokens only)
        self.spec_premise: tuple[int, tuple[int, ...]] | None = None
        self.grammar = None  # jvllm.structured.GrammarState of a constrained request (set by InputProcessor)

    # ------------------------------------------------------------------ state
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status._finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are still owed for positions computed from now on."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def max_prefix_hit_tokens(self) -> int:
        """How many leading tokens may come from the prefix cache instead of being computed.

        Always at least one token is computed (its logits give the next token). A position taken
        from the cache has no logits, so while prompt logprobs are owed a hit may cover only the
        positions whose entries are already recorded (entry p + 1 comes from position p's logits):
        none for a new request (vLLM gives such requests no hit), the recorded ones for a request
        recomputed after preemption."""
        cap = self.num_tokens - 1
        if self.needs_prompt_logprobs:
            cap = min(cap, len(self.prompt_logprobs) - 1)
        if self.hidden_chunks is not None:  # hidden states of every position are computed here
            cap = min(cap, self.num_hidden)
        return cap

    def add_hidden_states(self, start: int, hs):
        """Record the hidden states [L+1, n, hidden] of positions start .. start+n-1; positions
        already recorded (recomputed after preemption) are skipped."""
        if start > self.num_hidden:
            raise RuntimeError(f"request {self.request_id}: hidden states of positions {self.num_hidden}.."
                               f"{start - 1} were never computed")
        new = hs[:, self.num_hidden - start:]
        if new.shape[1]:
            self.hidden_chunks.append(new)
            self.num_hidden += new.shape[1]

    def hidden_states(self) -> dict | None:
        """{layer: [num_hidden, hidden]} of the layers asked for, or None."""
        if self.hidden_chunks is None:
            return None
        if not self.hidden_chunks:
            return {i: None for i in self.params.return_hidden_states}
        allh = self.hidden_chunks[0] if len(self.hidden_chunks) == 1 else np.concatenate(self.hidden_chunks, 1)
        self.hidden_chunks = [allh]
        return {i: allh[i] for i in self.params.return_hidden_states}

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens if self.params.max_tokens is not None else 2**31

    def append_token(self, token_id: int, logprob_entry: dict[int, Logprob] | None, logprob: float | None):
        """Record a sampled token, detokenize it and apply the stop conditions."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.logprobs is not None and logprob_entry is not None:
            self.logprobs.append(logprob_entry)
        if logprob is not None:
            self.cumulative_logprob += logprob
        p = self.params
        n = self.num_output_tokens
        stop_tok = (not p.ignore_eos and token_id in self.eos_token_ids) or token_id in p.stop_token_ids
        if stop_tok and n > p.min_tokens:
            self.status = Status.FINISHED_STOPPED
            # vLLM checks its EOS (the first of eos_token_ids: the tokenizer's) before the stop ids
            # and reports None for it; its other end tokens stop as stop_token_ids do, by id
            eos = not p.ignore_eos and bool(self.eos_token_ids) and token_id == self.eos_token_ids[0]
            self.stop_reason = None if eos else token_id
            # vLLM: a stop token's text (EOS included; empty when special tokens are skipped) is
            # output only with include_stop_str_in_output
            if self.detok is not None and p.include_stop_str_in_output:
                self.text += self.detok.step(token_id)
            return
        if self.detok is not None:
            delta = self.detok.step(token_id)
            if delta:
                start = max(0, len(self.text) - self.max_stop_len + 1)
                self.text += delta
                if p.stop and n > p.min_tokens:
                    self._check_stop_strings(start)
                    if self.is_finished:
                        return
        if n >= self.max_tokens or n >= self.length_cap:
            self.status = Status.FINISHED_LENGTH

    def _check_stop_strings(self, start: int):
        best = None
        for s in self.params.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
            self.status = Status.FINISHED_STOPPED
            self.stop_reason = s

    def streamable_text(self) -> str:
        """Text safe to show now: holds back a possible partial stop string while running."""
        if self.is_finished or self.max_stop_len <= 1:
            return self.text
        return self.text[: max(self.sent_text_len, len(self.text) - self.max_stop_len + 1)]
