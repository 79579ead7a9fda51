"""Turn validated API requests into engine inputs: prompts (token ids + text) and SamplingParams.

Every check that depends on the running server happens here, before a request is admitted, and
raises `APIError(400)` naming the field and the limit: batch size, n, number of stop strings,
vocabulary (prompt ids, stop_token_ids, logit_bias keys: all bad ones named, with the vocab size),
empty prompts, and prompt + max_tokens <= max_model_len (a prompt of max_model_len - 1 tokens plus
one generated token is accepted).

Text longer than `max_prompt_chars` is refused before it is tokenized (tokenizing megabytes takes
seconds): by default CHARS_PER_TOKEN_BOUND characters per position of max_model_len, far beyond
what any real text needs per token, so only prompts that could never fit are refused this way.

Hazard: the tokenizer is shared with the engine thread (which only decodes) and the app runs these
methods on several worker threads (so one long prompt delays no other request). Encoding never
changes truncation/padding state, so the Rust tokenizer is never mutably borrowed concurrently
("Already borrowed"): keep it that way (no truncation/padding arguments here). The constructor
encodes once, so a tokenizer saved with truncation or padding settings has them cleared before
any concurrent use.
"""
from __future__ import annotations

import dataclasses

from jvllm.sampling_params import RequestOutputKind, SamplingParams
from jvllm.server.chat import ChatOptions, render_chat
from jvllm.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from jvllm.server.structured import structured_params

CHARS_PER_TOKEN_BOUND = 32


@dataclasses.dataclass(frozen=True)
class Limits:
    """Amplification caps (per HTTP request). Each is a server flag: --max-n, --max-stop, --max-prompts,
    --max-prompt-chars (None: CHARS_PER_TOKEN_BOUND * max_model_len)."""

    max_n: int = 16
    max_stop: int = 16
    max_prompts: int = 32
    max_prompt_chars: int | None = None

    def __post_init__(self):
        for name, lo in (("max_n", 1), ("max_stop", 0), ("max_prompts", 1), ("max_prompt_chars", 1)):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < lo):
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


@dataclasses.dataclass
class Prompt:
    token_ids: list[int]
    text: str | None


class Renderer:
    def __init__(self, engine, limits: Limits, chat_template: str | None = None):
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.model_config.vocab_size
        self.max_model_len = engine.sched_config.max_model_len
        self.limits = limits
        self.chat_template = chat_template
        # the model's generation defaults for fields a request leaves unset (jvllm.generation_config)
        gen = getattr(engine, "generation_defaults", None)
        self.defaults = gen.sampling_dict() if gen is not None else {}
        self.max_chars = limits.max_prompt_chars or CHARS_PER_TOKEN_BOUND * self.max_model_len
        if self.tokenizer is not None:
            self.tokenizer("warm-up", add_special_tokens=False)  # settles truncation/padding state (see above)

    def check_chars(self, n: int, param: str):
        if n > self.max_chars:
            raise APIError(f"{param}: {n} characters is more than this server accepts ({self.max_chars} = "
                           f"--max-prompt-chars), far more text than fits in max_model_len "
                           f"{self.max_model_len} tokens", param=param)

    # ------------------------------------------------------------------ prompts
    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise APIError(f"this model was loaded without a tokenizer: {what} needs one (send token ids)",
                           param="prompt")

    def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        self._need_tokenizer("text input")
        self.check_chars(len(text), param)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def check_ids(self, ids: list[int], param: str):
        if not ids:
            raise APIError(f"{param} is empty (0 tokens)", param=param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"{param} has token ids {bad[:16]}{' ...' if len(bad) > 16 else ''} outside the "
                           f"vocabulary [0, {self.vocab_size})", param=param)

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids)

    def truncate(self, ids: list[int], k: int | None) -> list[int]:
        """The last `k` tokens (truncate_prompt_tokens; -1: max_model_len - 1, the most that leave
        room to generate). k > max_model_len is a 400, as in vLLM."""
        if k is None:
            return ids
        L = self.max_model_len
        if k == 0 or k > L:
            raise APIError(f"truncate_prompt_tokens must be -1 or in [1, max_model_len = {L}], got {k}",
                           param="truncate_prompt_tokens")
        return ids[-(L - 1 if k == -1 else k):]

    def completion_prompts(self, req: CompletionRequest) -> list[Prompt]:
        p = req.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            batch = [p]
        else:
            batch = list(p)
        if not batch:
            raise APIError("prompt is empty", param="prompt")
        if len(batch) > self.limits.max_prompts:
            raise APIError(f"prompt: at most {self.limits.max_prompts} prompts per request, got {len(batch)}",
                           param="prompt")
        out = []
        for item in batch:
            if isinstance(item, str):
                ids = self.encode(item, req.add_special_tokens) if item else []
                text = item
            else:
                ids, text = list(item), None
            cut = self.truncate(ids, req.truncate_prompt_tokens)
            if len(cut) < len(ids):
                ids, text = cut, (self.decode(cut) if text is not None or req.echo else None)
            self.check_ids(ids, "prompt")
            if text is None and req.echo:
                text = self.decode(ids)
            out.append(Prompt(ids, text))
        return out

    def chat_prompt(self, messages, opts: ChatOptions, truncate: int | None = None) -> Prompt:
        """`truncate`: the request's truncate_prompt_tokens (the text is then the kept tokens' text)."""
        self._need_tokenizer("chat")
        self.check_chars(sum(len(m.text()) for m in messages), "messages")
        text = render_chat(self.tokenizer, self.chat_template, messages, opts)
        ids = self.encode(text, opts.add_special_tokens, "messages")
        cut = self.truncate(ids, truncate)
        if len(cut) < len(ids):
            ids, text = cut, self.decode(cut)
        self.check_ids(ids, "messages")
        return Prompt(ids, text)

    # ------------------------------------------------------------------ sampling
    def check_common(self, req):
        """Server-dependent caps and cross-field rules shared by completions and chat."""
        lim = self.limits
        if req.n > lim.max_n:
            raise APIError(f"n must be <= {lim.max_n} (this server's --max-n), got {req.n}", param="n")
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > lim.max_stop:
            raise APIError(f"stop: at most {lim.max_stop} stop strings (this server's --max-stop), got "
                           f"{len(stops)}", param="stop")
        if req.best_of is not None and req.best_of > lim.max_n:
            raise APIError(f"best_of must be <= {lim.max_n} (this server's --max-n), got {req.best_of}",
                           param="best_of")
        if req.best_of is not None and req.best_of > req.n and req.stream:
            raise APIError(f"best_of ({req.best_of}) > n ({req.n}) cannot be streamed: the best sequences are "
                           f"known only at the end", param="best_of")
        bad = [t for t in (req.allowed_token_ids or []) if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"allowed_token_ids {bad[:16]} outside the vocabulary [0, {self.vocab_size})",
                           param="allowed_token_ids")
        if req.bad_words:
            self._need_tokenizer("bad_words")
        if req.stream_options is not None and not req.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        bad = [t for t in (req.stop_token_ids or []) if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"stop_token_ids {bad} outside the vocabulary [0, {self.vocab_size})",
                           param="stop_token_ids")
        if req.logit_bias:
            keys = []
            for k in req.logit_bias:
                try:
                    keys.append(int(k))
                except ValueError:
                    raise APIError(f"logit_bias keys must be token ids (integers as strings), got {k!r}",
                                   param="logit_bias") from None
            bad = [k for k in keys if not 0 <= k < self.vocab_size]
            if bad:
                raise APIError(f"logit_bias keys {bad} outside the vocabulary [0, {self.vocab_size})",
                               param="logit_bias")

    def sampling_params(self, req, prompt_len: int, max_tokens: int | None, logprobs: int | None,
                        length_param: str, max_tokens_param: str = "max_tokens",
                        prompt_logprobs: int | None = None, structured=None) -> SamplingParams:
        L = self.max_model_len
        if prompt_len >= L:
            raise APIError(f"This model's maximum context length is {L} tokens, but the prompt has {prompt_len} "
                           f"tokens, which leaves no room to generate", param=length_param)
        if max_tokens is None:
            max_tokens = L - prompt_len
            if self.defaults.get("max_tokens") is not None:  # the generation config's max_new_tokens
                max_tokens = min(max_tokens, self.defaults["max_tokens"])
        if prompt_len + max_tokens > L:
            raise APIError(f"This model's maximum context length is {L} tokens. However, you requested "
                           f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                           f"completion). Reduce the prompt or {max_tokens_param} to at most {L - prompt_len}.",
                           param=max_tokens_param)
        given = req.model_fields_set

        def field(name):  # the request's value, else the generation config's, else the field default
            return getattr(req, name) if name in given or name not in self.defaults else self.defaults[name]

        try:
            return SamplingParams(
                n=req.n, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=field("repetition_penalty"), temperature=field("temperature"),
                top_p=field("top_p"), top_k=field("top_k"), min_p=field("min_p"), seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, include_stop_str_in_output=req.include_stop_str_in_output,
                logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                best_of=req.best_of, allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
                output_kind=RequestOutputKind.DELTA, structured_outputs=structured,
                return_hidden_states=req.return_hidden_states,
                steering={int(k): v for k, v in req.steering.items()} if req.steering else None)
        except (ValueError, TypeError) as e:
            msg = str(e)
            raise APIError(msg, param=msg.split(" ", 1)[0].rstrip(":")) from None

    def completion_params(self, req: CompletionRequest, prompt: Prompt) -> SamplingParams:
        if req.suffix:
            raise APIError("suffix is not supported", param="suffix")
        plp = req.prompt_logprobs
        if req.echo and req.logprobs is not None:  # the echoed prompt's tokens carry logprobs too
            plp = max(plp or 0, req.logprobs)
        max_tokens = req.max_tokens
        if max_tokens == 0:  # vLLM / OpenAI: with echo, the prompt alone (one token runs, unshown)
            if not req.echo:
                raise APIError("max_tokens must be at least 1 (0 only with echo: the prompt alone)",
                               param="max_tokens")
            max_tokens = 1
        return self.sampling_params(req, len(prompt.token_ids), max_tokens, req.logprobs, "prompt",
                                    prompt_logprobs=plp, structured=structured_params(req))

    def chat_params(self, req: ChatCompletionRequest, prompt: Prompt, tool_constraint=None) -> SamplingParams:
        """`tool_constraint`: the StructuredOutputsParams of tool_choice 'required' / named (tools.py)."""
        so = structured_params(req)
        if so is not None and tool_constraint is not None:
            raise APIError("tool_choice 'required' or a named function constrains the output itself; it cannot be "
                           "combined with response_format / structured_outputs / guided_*", param="tool_choice")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
        lp = (req.top_logprobs or 0) if req.logprobs else None
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        mt = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return self.sampling_params(req, len(prompt.token_ids), mt, lp, "messages", name,
                                    prompt_logprobs=req.prompt_logprobs, structured=so or tool_constraint)
