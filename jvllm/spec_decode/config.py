"""SpeculativeConfig: vLLM's `speculative_config` dict, parsed and checked once (host only).

Accepted keys (vLLM's names): `method` ("ngram" or "draft_model"; None with a `model` means
"draft_model"), `model` (the draft: any model jvllm loads, sharing the target's tokenizer),
`num_speculative_tokens` (k, required), `prompt_lookup_max` / `prompt_lookup_min` (ngram; vLLM's
defaults: both 5 when neither is given, else the given one for both), `disable_by_batch_size`
(no new proposals while more requests than this are running or waiting; None: never).
Any other key is an error naming it; vLLM methods jvllm does not implement (eagle, medusa, ...)
are errors naming the method.
"""
from __future__ import annotations

import dataclasses

METHODS = ("ngram", "draft_model")
NOT_IMPLEMENTED_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix", "deepseek_mtp")
KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "disable_by_batch_size")
MAX_SPECULATIVE_TOKENS = 16  # verify programs are compiled per k; more buys nothing at real acceptance rates


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def from_dict(cls, d) -> "SpeculativeConfig":
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise TypeError(f"speculative_config must be a dict (vLLM's keys), got {type(d).__name__}")
        unknown = sorted(set(d) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown or unsupported key(s) {unknown}; jvllm takes {list(KEYS)}")
        method, model = d.get("method"), d.get("model")
        if method in ("[ngram]",):
            method = "ngram"
        if method is None:
            if model is None:
                raise ValueError("speculative_config needs a 'method' ('ngram') or a draft 'model'")
            method = "draft_model"
        if method in NOT_IMPLEMENTED_METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not implemented in jvllm; use one of {list(METHODS)}")
        if method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {method!r}; use one of {list(METHODS)}")
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an int in 1..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {k!r}")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if method == "ngram":
            if model is not None:
                raise ValueError(f"speculative_config: method 'ngram' takes no draft model (got model={model!r})")
            if lo is None and hi is None:
                lo = hi = 5
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"speculative_config: {name} must be an int >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
        else:
            if not isinstance(model, str) or not model:
                raise ValueError(f"speculative_config: method 'draft_model' needs a draft 'model' (got {model!r})")
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if v is not None:
                    raise ValueError(f"speculative_config: {name} is an ngram option; method is 'draft_model'")
        dbs = d.get("disable_by_batch_size")
        if dbs is not None and (not isinstance(dbs, int) or isinstance(dbs, bool) or dbs < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an int >= 1 or None, got {dbs!r}")
        return cls(method, k, model, hi, lo, dbs)
