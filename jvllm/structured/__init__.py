"""Structured outputs: a request's `StructuredOutputsParams` -> a grammar (llguidance) -> one
`GrammarState` per sequence, which fills the request's row of the packed token bitmask each step
and advances with each kept token. The sampler applies the mask on the device
(`jvllm.sampling.apply_token_mask`); see `backend` for the contracts."""
from jvllm.structured.backend import GrammarState, StructuredBackend, available, mask_words

__all__ = ["GrammarState", "StructuredBackend", "available", "mask_words"]
