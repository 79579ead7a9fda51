"""What every stage executor shares: the unit of work (one micro-batch's inputs), its result, the
`Pending` handle `launch` returns, and the two launches all executors make (a stage's step program,
the last stage's sampler and prompt logprobs).

Interface: `launch(work) -> Pending`; `prev_ids(pending)` -> what the next step's first stage takes
as prev_tok from a micro-batch still in flight. An executor is chosen once, at runner construction.
In-process executors implement `forward(work)` (every stage, no sampler) and get `launch` from
here, so the runner can also enqueue a micro-batch's forward now and its sampler later
(`late_sampling`: the host fills a grammar's mask while the forward runs); an executor without
`forward` (stages over processes) only launches whole micro-batches.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from jvllm.worker.stage import put


@dataclasses.dataclass
class Work:
    """One micro-batch's host inputs, and the hidden states moving through its stages."""
    group: list                # [(row of the step, ScheduledRequest)]
    sched: list                # the ScheduledRequests of `group`
    T: int
    R: int
    decode: bool
    packed: np.ndarray         # InputLayout.pack
    tok_in: object             # prev_tok for the first stage (a device array, or a Pending: multiprocess)
    plan: object = None        # sampler.SamplerPlan, or None: the argmax-only program serves every row
    x: object = None           # the last launched stage's output hidden states
    capture: bool = False      # some row wants its hidden states: the step_hidden variant (one stage)
    captured: object = None    # [num_layers + 1, T, hidden] on device, when `capture`
    procs_in: object = None    # logits_processors.ProcessorInputs (numpy) when some row uses one
    steer: tuple | None = None  # (vectors [R, L, hidden], row of each token [T]) numpy, when some row steers


@dataclasses.dataclass
class MicrobatchResult:
    group: list
    tok: object                # [R] sampled ids (device)
    logprobs: tuple | None     # (tok_lp, rank, top_ids, top_lp) on device, when some row wants them
    prompt_logprobs: tuple | None  # ({row: (offset, positions)}, device arrays) or None
    tok_pad: object            # ids padded to [max_num_seqs]: the next step's prev_tok
    hidden_states: object = None  # Work.captured


@dataclasses.dataclass
class Pending:
    """A launched micro-batch: its group now, its result once `result()` is called (which, for
    stages over processes, may first issue hand-offs still due)."""
    group: list
    value: MicrobatchResult | None = None
    resolve: Callable[[], None] | None = None

    def result(self) -> MicrobatchResult:
        if self.value is None:
            self.resolve()
        return self.value


class Executor:
    def __init__(self, runner):
        self.r = runner

    late_sampling = True  # implements `forward`: the sampler may be launched after the forward

    def launch(self, w: Work) -> Pending:
        return Pending(w.group, self.launch_sample(w, self.forward(w)))

    def forward(self, w: Work):
        """Enqueue every stage of `w`; the last stage's outputs, for `launch_sample`."""
        raise NotImplementedError

    def prev_ids(self, pending: Pending):
        """prev_tok for a micro-batch whose pending tokens come from `pending` (on stage 0)."""
        ids = pending.result().tok_pad
        shard = self.r.stages[0].sharding()
        return ids if shard is None else self.to_first(ids)

    def to_first(self, ids):
        import jax

        return jax.device_put(ids, self.r.stages[0].sharding())

    def release(self):
        pass

    # ------------------------------------------------------------------ shared launches
    def launch_stage(self, s_idx: int, w: Work, x):
        """Enqueue stage `s_idx` of `w` with input `x` (prev_tok or hidden states on the stage's devices)."""
        r = self.r
        st = r.stages[s_idx]
        t1 = time.perf_counter()
        packed = put(w.packed, st.sharding())  # this stage's host inputs: one transfer
        tm = r.timers
        tm["step_call_put_s"] += time.perf_counter() - t1
        if w.capture or w.steer is not None:
            steer = None if w.steer is None else tuple(put(a, st.sharding()) for a in w.steer)
            out = r.programs.get("step_research", (w.T, w.decode, w.capture, steer is not None))(
                st.params(), st.kv, packed, x, steer)
            if w.capture:
                *out, w.captured = out
                out = tuple(out)
        else:
            out = r.programs.get("step", (s_idx, w.T, w.decode))(st.params(), st.kv, packed, x)
        st.kv = out[0]
        w.x = out[-1]
        tm["step_call_s"] += time.perf_counter() - t1
        return out

    def launch_sample(self, w: Work, out) -> MicrobatchResult:
        """Enqueue the sampler (and prompt logprobs) of `w` after its last stage."""
        r = self.r
        t3 = time.perf_counter()
        _, last_h, all_h = out
        plan = w.plan
        if plan is None:
            tok, tok_pad = r.programs.get("greedy", w.R)(r.head_w, last_h)
            lp = None
        else:
            shard = r.stages[-1].sharding()
            rows = put(plan.rows, shard)  # every per-row sampler input: one transfer
            if w.procs_in is not None:  # user logits processors
                import jax

                pi = w.procs_in if shard is None else jax.tree_util.tree_map(lambda a: put(a, shard), w.procs_in)
                tok, lp, tok_pad = r.programs.get("sample_procs", (w.R, plan.variant))(r.head_w, last_h, rows, pi)
            else:
                tok, lp, tok_pad = r.programs.get("sample", (w.R, plan.variant))(r.head_w, last_h, rows)
        r.timers["sample_call_s"] += time.perf_counter() - t3
        plp = None
        if any(s.req.needs_prompt_logprobs for s in w.sched):
            plp = r.prompt_logprobs(w.sched, w.T, all_h)
        return MicrobatchResult(w.group, tok, lp if plan is not None and plan.want_lp else None, plp, tok_pad,
                                w.captured)
