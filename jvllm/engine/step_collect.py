"""Reading a dispatched step's results into the requests: `step_collect` (one step's rows), each
new token through the stop conditions and a grammar (`_append`), and a verified speculative row's
accepted drafts plus the target's token, with the rejected drafts' KV slots given back
(`_append_verified`). An error while reading fails that step's requests, never the engine.

A mixin of `jvllm.engine.llm_engine.LLMEngine`: it uses the engine's `runner`, `scheduler`,
`output`, `groups`, `speculator` and `stats`. Host only (no jax import).
"""
from __future__ import annotations

import logging
import time

from jvllm.engine.loop import StepHandle
from jvllm.engine.request import Status
from jvllm.outputs import RequestOutput

log = logging.getLogger("jvllm")


class StepCollect:
    def step_collect(self, handle: StepHandle) -> list[RequestOutput]:
        if handle.sched is None:
            return handle.outputs
        sched = handle.sched
        try:
            if handle.error is not None:
                raise handle.error
            t0 = time.perf_counter()
            res = self.runner.collect(handle.run)
            t1 = time.perf_counter()
            self.stats["device_wait_seconds"] += t1 - t0
        except Exception as e:  # an engine error fails the requests of this step, not the engine
            log.exception("step failed")
            for s in sched.scheduled:
                if s.samples:
                    s.req.num_pending = max(0, s.req.num_pending - 1)
                if s.req.is_finished:
                    continue
                s.req.error = f"{type(e).__name__}: {e}"
                self.scheduler.finish(s.req, Status.FINISHED_ERROR)
            return self.output.outputs(self.groups, {s.req.group_id for s in sched.scheduled})
        now = time.time()
        self.scheduler.update_after_step(sched)
        self.stats["num_steps"] += 1
        touched = set()
        op = self.output
        for r, s in enumerate(sched.scheduled):
            req = s.req
            touched.add(req.group_id)
            if s.start < req.num_prompt_tokens:
                self.stats["num_prompt_tokens"] += min(s.num_tokens, req.num_prompt_tokens - s.start)
            if r in res.prompt_logprobs:
                op.add_prompt_logprobs(req, *res.prompt_logprobs[r])
            if r in res.hidden_states:
                req.add_hidden_states(*res.hidden_states[r])
            if not s.samples:
                continue
            req.num_pending = max(0, req.num_pending - 1)
            if req.is_finished:  # stopped (or aborted) while this step was in flight: a wasted row
                continue
            if s.spec_token_ids:
                self._append_verified(s, res.spec[r], now)
                continue
            lp = None if res.logprobs is None else tuple(a[r] for a in res.logprobs)
            self._append(req, int(res.token_ids[r]), lp, now)
        outs = op.outputs(self.groups, touched)
        self.stats["host_seconds"] += time.perf_counter() - t1
        return outs

    def _append(self, req, tok: int, lps, now: float) -> bool:
        """Record one new token of `req` (`lps`: (logprob, rank, top ids, top logprobs) or None);
        False when the request finished (stopped, length, error)."""
        entry, lp = None, None
        if lps is not None:
            lp = float(lps[0])
            if req.params.logprobs is not None:
                entry = self.output.logprob_entry(tok, lp, int(lps[1]), lps[2], lps[3], req.params.logprobs,
                                                  req.params.detokenize)
        if req.grammar is not None:  # only kept tokens reach the grammar (wasted rows returned above)
            err = req.grammar.accept(tok)
            if err is not None:
                req.error = f"structured output: {err}"
                self.scheduler.finish(req, Status.FINISHED_ERROR)
                return False
        req.append_token(tok, entry, lp)
        self.stats["num_generation_tokens"] += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if req.is_finished:
            req.metrics.finished_time = now
            self.scheduler.finish(req, req.status)
            return False
        return True

    def _append_verified(self, s, res, now: float):
        """A verified row: its accepted drafts and the target's token, one by one through the stop
        conditions (a stop ends the row there), then the rejected drafts' KV slots rolled back."""
        toks = self.speculator.emitted(s, res)
        self.speculator.stats.record(len(s.spec_token_ids), len(toks) - 1)
        for j, tok in enumerate(toks):
            lps = None if res.logprobs is None else tuple(a[j] for a in res.logprobs)
            if not self._append(s.req, tok, lps, now):
                return
        self.scheduler.accept_speculated(s, len(toks) - 1)

