"""Structured outputs: a request's `StructuredOutputsParams` -> a grammar (llguidance) -> one
`GrammarState` per sequence, which fills the request's row of the packed token bitmask each step
and advances with each kept token. `jvllm.worker.sampler` packs the rows' masks (ANDed with
allowed_token_ids / bad_words where a request has both) into the batch's one sampler input and
`jvllm.sampling.sample` applies them on the device; see `backend` for the contracts."""
from jvllm.structured.backend import GrammarState, StructuredBackend, available, mask_words

__all__ = ["GrammarState", "StructuredBackend", "available", "mask_words"]
