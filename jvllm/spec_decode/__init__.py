"""Speculative decoding (vLLM's `speculative_config`): proposers (n-gram on the host, a draft model
with its own KV pool), the device rejection sampler, and the counters. The engine drives it through
`speculator.Speculator`; the scheduler gives each speculating request k + 1 query tokens and rolls
back the rejected ones (`Scheduler.accept_speculated`)."""
from jvllm.spec_decode.config import SpeculativeConfig  # noqa: F401
