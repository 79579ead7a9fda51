"""`SamplingParams`, shaped like vLLM's. Every invalid value raises ValueError naming the field and
the allowed range (`validate`); vocabulary-dependent checks happen in `validate_for_vocab`.

vLLM's semantics of the less common fields:
- `best_of`: sample best_of sequences and return the n with the highest cumulative logprob
  (None = n). best_of > n needs random sampling (greedy sequences are all equal); the group's
  output comes only when all best_of sequences finished (none of it can be streamed).
- `allowed_token_ids`: only these ids may be sampled. `bad_words`: each word is tokenized without
  and with a leading space (the second only when that gives a different first token and as many
  tokens); a one-token word is never sampled, a longer one bans its last token only while the
  output ends in its other tokens (`bad_word_bans`).
- `truncate_prompt_tokens`: keep the last k prompt tokens; -1 keeps the most that leave room to
  generate (max_model_len - 1: jvllm counts prompt + output against max_model_len).
- `detokenize=False`: outputs carry token ids only (text "", logprob entries without decoded
  text); stop strings then need text and are an error."""
from __future__ import annotations

import dataclasses
import enum
import numbers

import numpy as np

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
MAX_PROCESSOR_ARGS = 8  # numbers a request hands each logits processor (extra_args[name])
_INT64 = (-(2**63), 2**63 - 1)


def _token_id_key(k) -> int:
    """A logit_bias key as a token id: an integer (not a bool), an integral float, or the decimal
    string JSON gives; anything else (5563.9, True, "a") is a ValueError."""
    if isinstance(k, bool):
        raise ValueError(k)
    if isinstance(k, numbers.Integral):
        return int(k)
    if isinstance(k, float) and k.is_integer():
        return int(k)
    if isinstance(k, str) and k.strip().lstrip("+-").isdigit():
        return int(k)
    raise ValueError(k)


@dataclasses.dataclass
class StructuredOutputsParams:
    """A constraint on a request's output, as vLLM's: exactly one of `json` (a JSON schema: a dict,
    a JSON string, or a pydantic model class / instance's schema), `regex`, `choice` (a list of
    strings), `grammar` (a Lark grammar, or GBNF) or `json_object=True` (any JSON object).
    `whitespace_pattern`: a regex for the whitespace between JSON tokens (default: compact, no
    whitespace but single spaces after ':' and ','). The grammar is compiled (and a schema the
    backend rejects raises ValueError with the backend's reason) when the request is added."""

    json: object = None
    regex: str | None = None
    choice: list | None = None
    grammar: str | None = None
    json_object: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self):
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {kinds or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        for f in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, f)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"structured_outputs.{f} must be a string, got {type(v).__name__}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be True or False, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(
            k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # research (issue 23): transformers' output_hidden_states numbering, 0 = embeddings, num_layers
    # = after the final norm; CompletionOutput.hidden_states gets {layer: [num_tokens, hidden]}
    return_hidden_states: list[int] | None = None
    # names registered with LLM(logits_processors={name: fn}); extra_args[name]: that processor's
    # args (a number or up to MAX_PROCESSOR_ARGS numbers)
    logits_processors: list[str] | None = None
    # {layer: vector [hidden]} added to the residual stream of this request's tokens only, in the
    # return_hidden_states numbering (0 = the embeddings, i = after decoder layer i-1; < num_layers)
    steering: dict | None = None
    extra_args: dict | None = None
    best_of: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for f in ("stop", "stop_token_ids"):
            v = getattr(self, f)
            if v is not None and not isinstance(v, (list, tuple)):
                raise ValueError(f"{f} must be a list (stop: or one string), got {v!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t
                               for t in self.stop_token_ids or []]
        if isinstance(self.bad_words, str):
            raise ValueError(f"bad_words must be a list of strings, got the string {self.bad_words!r}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.logit_bias:
            try:
                self.logit_bias = {_token_id_key(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias must map integer token ids (or their decimal strings, as JSON "
                                 f"sends them) to floats, got {self.logit_bias!r}") from None
        self.validate()

    def validate(self):
        def bad(field, value, allowed):
            raise ValueError(f"{field} must be {allowed}, got {value!r}")

        for flag in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output", "detokenize"):
            if not isinstance(getattr(self, flag), bool):
                bad(flag, getattr(self, flag), "True or False")
        for f in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            v = getattr(self, f)
            if not isinstance(v, numbers.Real) or isinstance(v, bool):
                bad(f, v, "a number")
            setattr(self, f, float(v))  # numpy scalars become Python floats
        for f in ("n", "top_k", "min_tokens") + tuple(f for f in ("seed", "max_tokens", "logprobs", "prompt_logprobs")
                                                      if getattr(self, f) is not None):
            v = getattr(self, f)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool):
                bad(f, v, "an integer" + ("" if f in ("n", "top_k", "min_tokens") else " or None"))
            setattr(self, f, int(v))
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", self.output_kind, "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", self.n, "an integer >= 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0 ** 31:
            bad("repetition_penalty", self.repetition_penalty, "> 0")
        if not (self.temperature >= 0.0) or self.temperature > 1e4:
            bad("temperature", self.temperature, "in [0, 1e4]")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", self.top_k, "-1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or not _INT64[0] <= self.seed <= _INT64[1]):
            bad("seed", self.seed, "an integer within int64")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", self.logprobs, f"an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", self.prompt_logprobs, f"an integer in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", self.stop, "a list of non-empty strings")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "a list of integers")
        b = self.best_of
        if b is not None:
            if not isinstance(b, int) or isinstance(b, bool) or b < self.n:
                bad("best_of", b, f"None or an integer >= n ({self.n})")
            if b > self.n and self.greedy:
                bad("best_of", b, f"n ({self.n}) with greedy sampling (temperature 0: every sequence is the same)")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(not isinstance(t, int) or isinstance(t, bool)
                                                  for t in self.allowed_token_ids)):
            bad("allowed_token_ids", self.allowed_token_ids, "None or a non-empty list of token ids")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            bad("bad_words", self.bad_words, "a list of non-blank strings")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not (k == -1 or k >= 1)):
            bad("truncate_prompt_tokens", k, "None, -1 (as many as fit) or an integer >= 1")
        if not self.detokenize and self.stop:
            bad("stop", self.stop, "empty with detokenize=False (stop strings are matched in the text)")
        if self.logit_bias and len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"{len(self.logit_bias)} entries", f"at most {MAX_LOGIT_BIAS} entries")
        self._validate_research(bad)
        if self.logit_bias and any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            bad("logit_bias", self.logit_bias, "values in [-100, 100]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")

    def _validate_research(self, bad):
        h = self.return_hidden_states
        if h is not None:
            if (not isinstance(h, (list, tuple)) or not h or len(set(h)) != len(h)
                    or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in h)):
                bad("return_hidden_states", h, "a non-empty list of distinct layer indices >= 0")
            self.return_hidden_states = list(h)
        if self.steering is not None:
            if not isinstance(self.steering, dict) or not self.steering:
                bad("steering", self.steering, "a non-empty dict {layer index: vector}")
            st = {}
            for k, v in self.steering.items():
                if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                    bad("steering", k, "keys that are layer indices >= 0")
                try:
                    a = np.asarray(v, np.float32)
                except (TypeError, ValueError):
                    bad(f"steering[{k}]", type(v).__name__, "a vector of numbers")
                if a.ndim != 1 or not np.isfinite(a).all():
                    bad(f"steering[{k}]", f"shape {a.shape}", "a 1-D vector of finite numbers")
                st[k] = a
            self.steering = st
        lp = self.logits_processors
        if lp is not None:
            if not isinstance(lp, (list, tuple)) or not all(isinstance(n, str) for n in lp) or len(set(lp)) != len(lp):
                bad("logits_processors", lp, "a list of distinct registered processor names")
            self.logits_processors = list(lp)
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict):
                bad("extra_args", self.extra_args, "a dict {processor name: number or list of numbers}")
            for k, v in self.extra_args.items():
                if k not in (lp or ()):
                    bad("extra_args", k, f"a key naming one of this request's logits_processors {lp}")
                try:
                    n = len(np.atleast_1d(np.asarray(v, np.float32)))
                except (TypeError, ValueError):
                    bad(f"extra_args[{k!r}]", v, "a number or a list of numbers")
                if np.ndim(v) > 1 or n > MAX_PROCESSOR_ARGS:
                    bad(f"extra_args[{k!r}]", v, f"a number or a flat list of at most {MAX_PROCESSOR_ARGS} numbers")

    def cache_salt(self) -> bytes | None:
        """Seeds this request's prefix-cache hashes: steered KV is shared only with the same steering."""
        if not self.steering:
            return None
        import hashlib

        h = hashlib.sha256()
        for k in sorted(self.steering):
            h.update(str(k).encode() + self.steering[k].tobytes())
        return h.digest()

    def validate_processors(self, registered: tuple[str, ...]):
        """Every named logits processor must be registered with this engine."""
        unknown = [n for n in self.logits_processors or () if n not in registered]
        if unknown:
            raise ValueError(f"logits_processors {unknown} are not registered with this engine "
                             f"(registered: {list(registered)}; LLM(logits_processors={{name: fn}}))")

    def validate_for_model(self, num_layers: int, num_stages: int = 1, hidden_size: int | None = None):
        """Layer indices within the model (hidden states 0 .. num_layers, steering 0 .. num_layers-1),
        steering vectors of `hidden_size`; both need one pipeline stage."""
        for k, v in (self.steering or {}).items():
            if k >= num_layers:
                raise ValueError(f"steering layer {k} outside [0, {num_layers - 1}] (0 = the embeddings, "
                                 f"i = after decoder layer i-1)")
            if hidden_size is not None and v.shape != (hidden_size,):
                raise ValueError(f"steering[{k}] has shape {v.shape}; the model's hidden size is {hidden_size}")
        if self.steering and num_stages > 1:
            raise ValueError(f"steering needs pipeline_parallel_size 1, this engine has {num_stages} stages")
        h = self.return_hidden_states
        if h is None:
            return
        over = [i for i in h if i > num_layers]
        if over:
            raise ValueError(f"return_hidden_states {over} outside [0, {num_layers}] (0 = embeddings, "
                             f"{num_layers} = after the final norm)")
        if num_stages > 1:
            raise ValueError(f"return_hidden_states needs pipeline_parallel_size 1, this engine has {num_stages} stages")

    def validate_for_vocab(self, vocab_size: int):
        """Token ids (stop_token_ids, logit_bias keys) must lie in [0, vocab_size)."""
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} outside the vocabulary [0, {vocab_size})")
        bad = [t for t in (self.logit_bias or {}) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias keys {bad} outside the vocabulary [0, {vocab_size})")
        bad = [t for t in (self.allowed_token_ids or ()) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"allowed_token_ids {bad[:8]} outside the vocabulary [0, {vocab_size})")

    @property
    def num_seqs(self) -> int:
        """Sequences sampled for one prompt: best_of (None = n)."""
        return self.best_of or self.n

    @property
    def needs_logprobs(self) -> bool:
        """Whether the sampled tokens' logprobs must come back (asked for, or best_of ranks by them)."""
        return self.logprobs is not None or self.num_seqs > self.n

    @property
    def needs_mask(self) -> bool:
        """Whether rows of this request need the per-row vocabulary mask (allowed ids, bad words)."""
        return self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_extras(self) -> bool:
        """Whether this request needs the extras sampler variant: penalties, logit bias, min_tokens,
        or the vocabulary mask (allowed_token_ids, bad_words)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.min_tokens > 0 or self.needs_mask)

    def clone(self) -> "SamplingParams":
        return dataclasses.replace(self)


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """`LLM.beam_search`'s parameters, shaped like vLLM's (jvllm.beam_search has the algorithm).

    beam_width: beams kept per prompt (each step asks the engine for 2 * beam_width candidates per
    beam, so at most MAX_LOGPROBS // 2); max_tokens: steps; ignore_eos: EOS ends no beam;
    temperature: 0 ranks candidates only by logprob, above 0 each beam's sampled token joins its
    candidates (as in vLLM); length_penalty: the exponent of the length a beam's cumulative logprob
    is divided by when beams are ranked; include_stop_str_in_output: a finished beam's text keeps
    the EOS token's text."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        def bad(field, value, allowed):
            raise ValueError(f"{field} must be {allowed}, got {value!r}")

        w = self.beam_width
        if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= MAX_LOGPROBS // 2:
            bad("beam_width", w, f"an integer in [1, {MAX_LOGPROBS // 2}] (2 * beam_width candidates per beam "
                                 f"are at most {MAX_LOGPROBS} logprobs)")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 1e4:
            bad("temperature", self.temperature, "in [0, 1e4]")
        lp = self.length_penalty
        if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not -1e3 <= lp <= 1e3:
            bad("length_penalty", lp, "a finite float in [-1000, 1000]")
        for flag in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, flag), bool):
                bad(flag, getattr(self, flag), "True or False")
