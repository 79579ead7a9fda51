"""Output processing: a step's sampled ids and logprobs -> the requests' tokens and logprob entries
-> RequestOutput (final only, cumulative or delta, as each request asked).

best_of > n: nothing is output until all best_of sequences finished; then the n with the highest
cumulative logprob are output, best first, numbered 0..n-1 (their first output is the whole
sequence, also for DELTA)."""
from __future__ import annotations

from jvllm.engine.request import Request
from jvllm.outputs import CompletionOutput, Logprob, RequestOutput
from jvllm.sampling_params import RequestOutputKind


class RequestGroup:
    """A user request: n sequences with one id."""

    def __init__(self, request_id, prompt, prompt_token_ids, params, seqs):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs: list[Request] = seqs

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        return seqs[0].status._finished if len(seqs) == 1 else all(s.status._finished for s in seqs)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _decode_one(self, tid: int, decode: bool) -> str | None:
        return None if self.tokenizer is None or not decode else self.tokenizer.decode([int(tid)])

    def logprob_entry(self, tok, lp, rank, top_ids, top_lps, n, decode: bool = True) -> dict:
        """{token id: Logprob} of the sampled token and the top `n` (rank 1 = best); decoded text
        only when `decode` (the request's detokenize)."""
        entry = {tok: Logprob(lp, rank, self._decode_one(tok, decode))}
        for i in range(n):
            t = int(top_ids[i])
            if t not in entry:
                entry[t] = Logprob(float(top_lps[i]), i + 1, self._decode_one(t, decode))
        return entry

    def add_prompt_logprobs(self, req: Request, pos, tok_lp, rank, top_ids, top_lps):
        n = req.params.prompt_logprobs
        for j, p in enumerate(pos):
            if len(req.prompt_logprobs) != p + 1:
                continue  # already recorded (recompute after preemption)
            t = req.prompt_token_ids[p + 1]
            req.prompt_logprobs.append(self.logprob_entry(t, float(tok_lp[j]), int(rank[j]), top_ids[j], top_lps[j], n,
                                                          req.params.detokenize))

    def outputs(self, groups: dict, group_ids) -> list[RequestOutput]:
        """The outputs of `group_ids` (finished groups leave `groups`)."""
        outs = []
        for gid in group_ids:
            g = groups.get(gid)
            if g is None:
                continue
            out = self.make_output(g)
            if out is not None:
                outs.append(out)
            if g.finished:
                del groups[gid]
        return outs

    def make_output(self, g: RequestGroup) -> RequestOutput | None:
        kind = g.params.output_kind
        finished = g.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        seqs = g.seqs
        if g.params.num_seqs > g.params.n:
            if not finished:
                return None
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:g.params.n]
        comps = []
        for rank, s in enumerate(seqs):
            text = s.streamable_text()
            ids, lps = s.output_token_ids, s.logprobs
            if kind is RequestOutputKind.DELTA:
                t0, k0 = s.sent_text_len, s.sent_token_len
                s.sent_text_len, s.sent_token_len = len(text), len(ids)
                text, ids = text[t0:], ids[k0:]
                lps = lps[k0:] if lps is not None else None
            comps.append(CompletionOutput(
                index=rank if seqs is not g.seqs else s.index, text=text, token_ids=list(ids),
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
                logprobs=lps, finish_reason=s.status.reason, stop_reason=s.stop_reason,
                hidden_states=s.hidden_states()))
        s0 = g.seqs[0]
        return RequestOutput(request_id=g.request_id, prompt=g.prompt, prompt_token_ids=g.prompt_token_ids,
                             prompt_logprobs=s0.prompt_logprobs, outputs=comps, finished=finished,
                             metrics=s0.metrics, num_cached_tokens=s0.metrics.num_cached_tokens)
