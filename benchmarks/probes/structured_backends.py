"""Compare grammar engines for structured outputs on SmolLM2's tokenizer (49,152 ids), on the CPU:
schema compile time, and the time to fill one request's packed token mask per step (mean over the
steps of one valid JSON document, tokenized, fed token by token). Prints one JSON line per backend.

    PYTHONPATH=. python benchmarks/probes/structured_backends.py

Backends: llguidance, xgrammar (needs torch for its bitmask tensor), outlines-core (regex from
the schema, an index over the whole vocabulary). A backend that is not installed is skipped.
"""
from __future__ import annotations

import json
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 10000},
        "name": {"type": "string", "maxLength": 40},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                        "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["id", "name", "role", "tags", "address", "score"],
    "additionalProperties": False,
}
DOC = '{"id":42,"name":"Ada Lovelace","role":"admin","tags":["math","engines"],"address":{"city":"London","zip":"12345"},"score":0.75}'
V = 49152


def tokenizer():
    from transformers import AutoTokenizer

    from tests.helpers import smollm2_tokenizer_dir

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())


def bench_llguidance(tok, ids):
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    t = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=V)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(lt, g)
    compile_s = time.perf_counter() - t
    mask = lnp.allocate_token_bitmask(1, V)
    times = []
    for i in ids:
        t = time.perf_counter()
        lnp.fill_next_token_bitmask(m, mask, 0)
        times.append(time.perf_counter() - t)
        assert m.consume_token(i), m.get_error()
    return dict(backend="llguidance", version=llguidance.__version__ if hasattr(llguidance, "__version__") else None,
                tokenizer_setup_s=setup, compile_s=compile_s, times=times)


def bench_xgrammar(tok, ids):
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
    comp = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    m = xgr.GrammarMatcher(cg)
    compile_s = time.perf_counter() - t
    mask = xgr.allocate_token_bitmask(1, V)
    times = []
    for i in ids:
        t = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t)
        assert m.accept_token(i)
    return dict(backend="xgrammar", version=getattr(xgr, "__version__", None), tokenizer_setup_s=setup, compile_s=compile_s, times=times)


def bench_outlines(tok, ids):
    import outlines_core
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t = time.perf_counter()
    eos = tok.eos_token_id
    vocab: dict[str, list[int]] = {}
    for s, i in tok.get_vocab().items():
        if i != eos and i < V:
            vocab.setdefault(s, []).append(i)
    voc = Vocabulary(eos, vocab)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    idx = Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=""), voc)
    g = Guide(idx)
    compile_s = time.perf_counter() - t
    mask = np.zeros((V + 31) // 32, np.int32)
    times = []
    for i in ids:
        t = time.perf_counter()
        g.write_mask_into(mask.ctypes.data, mask.size, 4)
        times.append(time.perf_counter() - t)
        g.advance(i)
    return dict(backend="outlines-core", version=getattr(outlines_core, "__version__", None),
                tokenizer_setup_s=setup, compile_s=compile_s, times=times)


def main():
    tok = tokenizer()
    ids = tok.encode(DOC, add_special_tokens=False)
    for fn in (bench_llguidance, bench_xgrammar, bench_outlines):
        try:
            r = fn(tok, ids)
        except ImportError as e:
            print(json.dumps(dict(backend=fn.__name__[6:], skipped=str(e))))
            continue
        except Exception as e:
            print(json.dumps(dict(backend=fn.__name__[6:], error=f"{type(e).__name__}: {e}")))
            continue
        ts = np.array(r.pop("times")) * 1e6
        r.update(steps=len(ts), mask_us_mean=float(ts.mean()), mask_us_p50=float(np.median(ts)),
                 mask_us_max=float(ts.max()))
        print(json.dumps(r))


COVERAGE = {  # feature -> schema; a backend "covers" it when it compiles the schema
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
                       "$ref": "#/$defs/n"},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "pattern": {"type": "string", "pattern": "^[a-z]{3}[0-9]+$"},
    "min/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "min/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "format: date-time": {"type": "string", "format": "date-time"},
    "exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string"}}}]},
    "if/then (unsupported: should be refused)": {"if": {"type": "string"}, "then": {"maxLength": 2}},
}


def coverage(tok):
    out = {}
    try:
        import llguidance
        import llguidance.hf

        lt = llguidance.hf.from_tokenizer(tok, n_vocab=V)
        out["llguidance"] = {k: not llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s)), lt) for k, s in COVERAGE.items()}
    except ImportError:
        pass
    try:
        import xgrammar as xgr

        comp = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V))
        res = {}
        for k, s in COVERAGE.items():
            try:
                comp.compile_json_schema(json.dumps(s))
                res[k] = True
            except Exception:
                res[k] = False
        out["xgrammar"] = res
    except ImportError:
        pass
    try:
        from outlines_core.json_schema import build_regex_from_schema

        res = {}
        for k, s in COVERAGE.items():
            try:
                build_regex_from_schema(json.dumps(s))
                res[k] = True
            except Exception:
                res[k] = False
        out["outlines-core"] = res
    except ImportError:
        pass
    return out


if __name__ == "__main__":
    main()
    print(json.dumps(coverage(tokenizer()), indent=1))
