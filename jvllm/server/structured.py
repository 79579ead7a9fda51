"""The structured-output fields of a request -> one `StructuredOutputsParams` (or None).

Sources (at most one may ask for a constraint; two are a 400 naming both): OpenAI's
`response_format` ({"type": "text"} asks for nothing; "json_object"; "json_schema" with
{"json_schema": {"name", "schema", "strict"}}), vLLM's `structured_outputs` object (json, regex,
choice, grammar, json_object, whitespace_pattern), and vLLM's legacy `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (with `guided_whitespace_pattern`). Tool calling
with tool_choice "required" or a named function brings its own constraint (`tools.py`) and cannot
be combined with these. The grammar itself is compiled (and rejected with the backend's reason)
when the engine takes the request.
"""
from __future__ import annotations

from jvllm.sampling_params import StructuredOutputsParams
from jvllm.server.protocol import APIError

_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object", "whitespace_pattern")
_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _make(param: str, **kw) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except (ValueError, TypeError) as e:
        raise APIError(f"{param}: {e}", param=param) from None


def _response_format(rf: dict) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict) or "type" not in rf:
        raise APIError("response_format must be an object with a 'type' (text, json_object, json_schema)",
                       param="response_format")
    t = rf["type"]
    if t == "text":
        return None
    if t == "json_object":
        return _make("response_format", json_object=True)
    if t == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
            raise APIError("response_format.json_schema must be an object with a 'schema' object",
                           param="response_format")
        # strict true/false: the schema is enforced either way (a grammar never lets the output stray)
        return _make("response_format", json=js.get("schema", {"type": "object"}))
    raise APIError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {t!r}",
                   param="response_format")


def structured_params(req) -> StructuredOutputsParams | None:
    """The constraint a completions / chat request asks for; APIError(400) for a malformed or
    conflicting one."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if req.response_format is not None:
        so = _response_format(req.response_format)
        if so is not None:
            found.append(("response_format", so))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        if not isinstance(so, dict):
            raise APIError("structured_outputs must be an object", param="structured_outputs")
        bad = sorted(k for k in so if k not in _SO_KEYS)
        if bad:
            raise APIError(f"structured_outputs: {bad} are not supported by jvllm (it takes {list(_SO_KEYS)})",
                           param="structured_outputs")
        kw = {k: v for k, v in so.items() if v is not None and v is not False}
        found.append(("structured_outputs", _make("structured_outputs", **kw)))
    legacy = {k: getattr(req, k) for k in _LEGACY if getattr(req, k) is not None}
    if len(legacy) > 1:
        raise APIError(f"only one of {sorted(legacy)} may be given", param=sorted(legacy)[1])
    for k, v in legacy.items():
        found.append((k, _make(k, **{_LEGACY[k]: v, "whitespace_pattern": req.guided_whitespace_pattern})))
    if req.guided_whitespace_pattern is not None and not legacy:
        raise APIError("guided_whitespace_pattern needs guided_json", param="guided_whitespace_pattern")
    if len(found) > 1:
        raise APIError(f"{found[0][0]} and {found[1][0]} both ask for a structured output; send one",
                       param=found[1][0])
    return found[0][1] if found else None
