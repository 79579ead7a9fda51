"""The grammar engine behind structured outputs: llguidance (benchmarks/README.md says why it was
chosen over xgrammar and outlines-core). Host only: no jax.

`StructuredBackend(tokenizer, vocab_size)` is built once per engine (lazily: the tokenizer's
token trie is read on the first constrained request). `compile(params)` turns a
`StructuredOutputsParams` into a grammar and raises ValueError with llguidance's reason when it
rejects it (before anything is scheduled); `state(grammar)` gives one sequence its matcher.

Mask layout: int32 words [ceil(vocab_size / 32)] per row, bit j of word i = token 32 * i + j
allowed (little-endian bit order; ids the tokenizer does not have stay 0). Ids that the engine
treats as EOS are allowed exactly where the grammar may end.

Hazard: a `GrammarState` must see every kept token, in order, and nothing else: a token that was
sampled but discarded (a row wasted after a stop) must not reach `accept`.
"""
from __future__ import annotations

import json
import re

import numpy as np

from jvllm.sampling_params import StructuredOutputsParams


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def available() -> bool:
    """Whether the grammar engine is installed (without importing it): engines then warm up the
    masked sampler variants too, so a first constrained batch compiles nothing."""
    import importlib.util

    return importlib.util.find_spec("llguidance") is not None


def _import():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError:
        raise ValueError("structured_outputs needs llguidance: pip install 'jvllm[structured]'") from None
    return llguidance


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher, eos_token_ids: tuple, vocab_size: int):
        """`eos_token_ids`: the engine's EOS ids and the grammar tokenizer's own EOS."""
        self._m = matcher
        self._eos = tuple(sorted({t for t in eos_token_ids if 0 <= t < vocab_size}))

    def fill(self, row: np.ndarray):
        """Write the allowed next tokens into `row` (int32 [mask_words(V)], zeroed by the caller)."""
        import llguidance.numpy as lnp

        lnp.fill_next_token_bitmask(self._m, row[None, :], 0)
        if self._m.is_accepting() or self._m.is_stopped():
            for t in self._eos:
                row[t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))

    def accept(self, token_id: int) -> str | None:
        """Advance by a kept token; None, or llguidance's reason when the token breaks the grammar
        (an EOS where the grammar may end is accepted and ends it)."""
        if token_id in self._eos and (self._m.is_accepting() or self._m.is_stopped()):
            return None
        if self._m.consume_token(token_id):
            return None
        return self._m.get_error() or f"token {token_id} is not allowed by the grammar"

    @property
    def done(self) -> bool:
        """The grammar allows no more tokens (only EOS)."""
        return self._m.is_stopped()


class StructuredBackend:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._lltok = None

    def _tok(self):
        llg = _import()
        if self._lltok is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer (skip_tokenizer_init is set)")
            self._lltok = llg.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
        return self._lltok

    def compile(self, so: StructuredOutputsParams) -> str:
        """The llguidance grammar of `so`; ValueError with the backend's reason if it is rejected."""
        llg = _import()
        M = llg.LLMatcher
        try:
            kind = so.kind
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else so.json
                if hasattr(schema, "model_json_schema"):
                    schema = schema.model_json_schema()
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError(f"structured_outputs.json must be a schema dict or JSON string, "
                                     f"got {type(schema).__name__}")
                opts = ({"whitespace_pattern": so.whitespace_pattern} if so.whitespace_pattern is not None
                        else {"whitespace_flexible": False})
                g = M.grammar_from_json_schema(json.dumps(schema), defaults=opts)
            elif kind == "regex":
                g = M.grammar_from_regex(so.regex)
            elif kind == "choice":
                g = M.grammar_from_regex("|".join(f"({re.escape(c)})" for c in so.choice))
            else:
                text = so.grammar
                if "::=" in text:  # GBNF (llama.cpp / vLLM's xgrammar EBNF)
                    from llguidance.gbnf_to_lark import gbnf_to_lark  # a module of llguidance: its function

                    text = gbnf_to_lark(text)
                g = M.grammar_from_lark(text)
        except ValueError as e:
            raise ValueError(f"structured_outputs ({so.kind}) rejected: {e}") from None
        except Exception as e:  # llguidance raises its own errors for malformed input
            raise ValueError(f"structured_outputs ({so.kind}) rejected: {type(e).__name__}: {e}") from None
        err = M.validate_grammar(g, self._tok())
        if err:
            raise ValueError(f"structured_outputs ({so.kind}) rejected by llguidance: {err.strip()}")
        return g

    def state(self, grammar: str) -> GrammarState:
        llg = _import()
        m = llg.LLMatcher(self._tok(), grammar)
        if m.is_error():
            raise ValueError(f"structured_outputs rejected by llguidance: {m.get_error()}")
        return GrammarState(m, self.eos_token_ids + (self._tok().eos_token,), self.vocab_size)
