"""Result objects, shaped like vLLM's (`RequestOutput`, `CompletionOutput`, `Logprob`)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    # {layer: [num_tokens, hidden]} when SamplingParams.return_hidden_states asked (prompt tokens,
    # then generated ones; the last generated token was never fed to the model, so it has none)
    hidden_states: dict | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
