"""Request models of the OpenAI-compatible API (plus vLLM's sampling extras) and the error shape.

Contracts:
- Every model is *strict*: a wrong JSON type ("max_tokens": "5", "stream": "yes") is a 400, never
  coerced. Floats refuse NaN/Infinity. Static ranges live here (they show up in /openapi.json, so
  schemathesis generates inside them); limits that depend on the running server (max n, number of
  stop strings, max_model_len, vocabulary) are checked in `render.py` and patched into the
  OpenAPI schema by `app.py`.
- An explicit JSON null in a field that has a default and no meaning for null ("temperature":
  null, as the openai SDK sends for a None argument) means that default, as in vLLM / OpenAI;
  fields where null means something ("max_tokens": null, "seed": null) keep it, and null in a
  required field is a 400.
- The request models and their parts (messages, text parts, stream_options) keep fields they do
  not declare in `model_extra`; `fields.check_extra_fields` refuses the top-level ones jvllm knows
  but does not implement and names every other one (parts too) in a log warning.
- `APIError` carries the OpenAI error body `{"error": {"message", "type", "param", "code"}}`; the
  app turns it (and FastAPI's own validation errors) into a JSON response with that status.
"""
from __future__ import annotations

import functools
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20  # jvllm.sampling_params.MAX_LOGPROBS (not imported: keeps this module jax-free)
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 256
MAX_STOP_STR_LEN = 512  # the engine scans every stop string on every token: bound the work

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                431: "invalid_request_error",
                429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error answered to the client as `{"error": {...}}` with HTTP `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, type: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param, self.type)


def safe_text(s: str) -> str:
    """`s` with lone surrogates written as backslash escapes (JSON answers must be valid UTF-8)."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, status: int, param: str | None = None, type: str | None = None) -> dict:
    message, param = safe_text(message), None if param is None else safe_text(param)
    return {"error": {"message": message, "type": type or _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


def _admits_none(tp) -> bool:
    if tp is None or tp is type(None) or tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _admits_none(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return any(_admits_none(a) for a in typing.get_args(tp))
    return False


@functools.cache
def _null_means_default(cls) -> frozenset:
    """Keys of `cls`'s optional fields whose type has no null: a null there is dropped."""
    return frozenset(f.alias or name for name, f in cls.model_fields.items()
                     if not f.is_required() and not _admits_none(f.annotation))


class _Request(_Strict):
    """A request body or a part of one: undeclared fields are kept (model_extra) for
    `check_extra_fields`; a null in an optional non-nullable field is its default."""
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _drop_default_nulls(cls, data):
        if isinstance(data, dict):
            keys = _null_means_default(cls)
            if any(data.get(k, 0) is None for k in keys):
                data = {k: v for k, v in data.items() if v is not None or k not in keys}
        return data


NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]
StopStr = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_STR_LEN)]


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM: with include_usage, every chunk carries "
                                         "the usage so far")


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = Field(None, description="one of the served model names; omitted = the first one")
    n: int = Field(1, ge=1, description="choices per prompt (capped by the server's --max-n)")
    temperature: float = Field(1.0, ge=0.0, le=1e4)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: StopStr | list[StopStr] | None = Field(
        None, description=f"stop strings of 1..{MAX_STOP_STR_LEN} characters (count capped by --max-stop)")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[Annotated[str, StringConstraints(pattern=r"^-?[0-9]+$")],
                     Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id (as a string) -> bias in [-100, 100]")
    user: str | None = None
    # vLLM extras
    top_k: int = Field(0, ge=-1, le=2**31 - 1, description="0 or -1: off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0**31)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = Field(None, min_length=1, description="only these ids may be sampled")
    bad_words: list[StopStr] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS,
                                            description="words never generated (vLLM's rules)")
    best_of: int | None = Field(None, ge=1, description="sample best_of, return the n with the highest cumulative "
                                "logprob (capped by --max-n; not with stream)")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=2**31 - 1,
                                               description="keep the last k prompt tokens; -1: max_model_len - 1")
    # structured outputs (server/structured.py reads them; at most one may ask for a constraint)
    response_format: dict[str, Any] | None = Field(None, description="{'type': 'text' | 'json_object' | "
                                                   "'json_schema', 'json_schema': {'name', 'schema', 'strict'}}")
    structured_outputs: dict[str, Any] | None = Field(None, description="vLLM: {json | regex | choice | grammar | "
                                                      "json_object, whitespace_pattern}")
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # research hooks (jvllm's SamplingParams fields of the same names; the engine checks the layer
    # range and the vector size). Layers in transformers' output_hidden_states numbering.
    return_hidden_states: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(
        None, min_length=1, description="layers (0 = embeddings, num_layers = after the final norm): each choice "
        "gets hidden_states {layer: one [hidden] list per token}, prompt and generated tokens (the last sampled "
        "token has none: it was never fed to the model)")
    steering: dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")],
                   Annotated[list[float], Field(min_length=1)]] | None = Field(None, min_length=1, description="{layer (0 = embeddings, i = after decoder layer i-1): "
                       "vector [hidden]} added to the residual stream of this request's tokens only")


class CompletionRequest(_SamplingFields):
    prompt: NonEmptyStr | Annotated[list[int], Field(min_length=1)] | Annotated[list[str], Field(min_length=1)] \
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)] = Field(
        ..., description="text, token ids, or a batch of either (batch size capped by --max-prompts)")
    max_tokens: int | None = Field(16, ge=0, le=2**31 - 1,
                                   description="null: up to max_model_len; prompt + max_tokens <= max_model_len; "
                                               "0 only with echo (the prompt alone, with its logprobs)")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = Field(None, max_length=0, description="not supported: null or empty")
    add_special_tokens: bool = True


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """One message; `name`, `tool_calls` and `tool_call_id` reach the chat template as given."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as the chat template takes it (`jvllm.inputs.content_text`, shared with
        `LLM.chat`: text parts joined with a newline, as vLLM does)."""
        from jvllm.inputs import content_text

        return content_text(self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = Field(None, description="a Jinja chat template for this request (needs the "
                                      "server's --trust-request-chat-template)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat template")
    tools: list[dict[str, Any]] | None = Field(None, description="function tools: passed to the chat template; "
                                               "calls come back parsed as tool_calls (server/tools.py)")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = Field(
        None, description="default 'auto' with tools ('auto' needs --enable-auto-tool-choice and --tool-call-parser)")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (tool_choice 'required')")


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="passed to the chat template")


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
