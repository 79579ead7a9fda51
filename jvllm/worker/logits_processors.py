"""User logits processors (`LLM(logits_processors={"name": fn})`), compiled into one sampler
variant (`sample_procs`) that only batches with a request using one of them run.

Contract of a processor: a jittable `fn(logits [R, V] float32, output_token_ids [R, max_model_len]
int32, args [R, MAX_PROCESSOR_ARGS] float32) -> logits [R, V]`. `output_token_ids` holds each
row's generated ids so far, padded with -1; `args` is the request's
`SamplingParams.extra_args[name]` (a number or up to MAX_PROCESSOR_ARGS numbers, zeros after). A
processor runs on every row of the batch, but its result is kept only for rows whose request
named it (`SamplingParams.logits_processors`), in registration order; the others keep their logits
untouched. Logprobs are those of the processed logits. Processors run before penalties, logit
bias, temperature and top-k/p.

Hazard: a processor is traced once per request bucket: Python side effects run at trace time only,
and it must not depend on R beyond shapes.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.sampling_params import MAX_PROCESSOR_ARGS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProcessorInputs:
    active: jax.Array        # [R, P] bool: row r uses processor p
    args: jax.Array          # [R, P, MAX_PROCESSOR_ARGS] f32
    output_ids: jax.Array    # [R, max_model_len] i32, -1 padded


def check_registry(procs) -> tuple[tuple[str, object], ...]:
    """The registered processors as ((name, fn), ...); ValueError naming a bad entry."""
    if procs is None:
        return ()
    if not isinstance(procs, dict):
        raise ValueError(f"logits_processors must be a dict {{name: fn}}, got {type(procs).__name__}")
    for name, fn in procs.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"logits_processors: name {name!r} must be a non-empty string")
        if not callable(fn):
            raise ValueError(f"logits_processors[{name!r}] must be callable, got {type(fn).__name__}")
    return tuple(procs.items())


def layout(R: int, P: int, max_model_len: int) -> dict:
    return dict(active=((R, P), np.bool_), args=((R, P, MAX_PROCESSOR_ARGS), np.float32),
                output_ids=((R, max_model_len), np.int32))


def abstract_inputs(R: int, P: int, max_model_len: int, sharding=None) -> ProcessorInputs:
    return ProcessorInputs(**{k: jax.ShapeDtypeStruct(s, d, sharding=sharding)
                              for k, (s, d) in layout(R, P, max_model_len).items()})


def uses_processors(scheduled) -> bool:
    return any(s.req.params.logits_processors for s in scheduled)


def host_inputs(scheduled, R: int, names: tuple[str, ...], max_model_len: int) -> ProcessorInputs:
    """numpy ProcessorInputs for the rows of `scheduled` (padded to R)."""
    a = {k: np.zeros(s, d) for k, (s, d) in layout(R, len(names), max_model_len).items()}
    a["output_ids"][:] = -1
    col = {n: j for j, n in enumerate(names)}
    for r, s in enumerate(scheduled):
        p = s.req.params
        for n in p.logits_processors or ():
            a["active"][r, col[n]] = True
            v = np.atleast_1d(np.asarray((p.extra_args or {}).get(n, ()), np.float32))
            a["args"][r, col[n], :len(v)] = v
        out = s.req.output_token_ids[:max_model_len]
        a["output_ids"][r, :len(out)] = out
    return ProcessorInputs(**a)


def apply(procs, logits, pi: ProcessorInputs):
    """Run every processor, keep its result on the rows that use it (inside the sampler program)."""
    for j, (name, fn) in enumerate(procs):
        new = fn(logits, pi.output_ids, pi.args[:, j])
        if new.shape != logits.shape:
            raise ValueError(f"logits processor {name!r} returned shape {new.shape}, expected {logits.shape}")
        logits = jnp.where(pi.active[:, j:j + 1], new.astype(jnp.float32), logits)
    return logits
