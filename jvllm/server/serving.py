"""/v1/completions and /v1/chat/completions: submit to the AsyncEngine, then answer as one JSON
body or as Server-Sent Events.

Contracts:
- All validation happens before admission (render.py), and the engine accepts the request before
  any byte of a stream is sent: a bad request is always a JSON error, never a half stream.
- Streams send `data: {chunk}\\n\\n` events and end with `data: [DONE]`. With
  stream_options.include_usage, every chunk has "usage": null (with vLLM's continuous_usage_stats:
  its choice's usage so far, `_chunk`) and one last chunk with no choices
  carries the usage. A request that fails in the engine sends its finish_reason "error" and then
  an `{"error": ...}` event before [DONE]; the server goes on.
- Choice index = prompt index * n + sample index (completions with a batch of prompts).
- A client that disconnects cancels the handler (streams: starlette cancels the generator;
  bodies: `watch_disconnect`), and `Submission.close()` in the `finally` aborts the engine
  requests at once, which frees their KV blocks before the engine's next step.
- Chat with tools (`tool_mode`, tools.py): the finished text is parsed into `message.tool_calls`
  (content: the text before the calls, or null; finish_reason: `ToolMode.finish_reason`); streamed, content
  flows until a call may begin, then `delta.tool_calls` chunks carry each call's name and then its
  arguments as they are generated (tool_stream.py).
- Logprob, hidden-state and text_offset JSON shapes: formats.py.
- /v1/completions with echo and logprobs: the prompt's tokens lead `logprobs` (the first with
  null logprob and null top_logprobs, as in vLLM), then the generated ones, with one text_offset
  list over both (formats.py), the same streamed or not. Streamed, the echo chunk waits for the
  prompt logprobs.
- `return_hidden_states` (research hooks): each choice carries `hidden_states` {"layer": one
  [hidden] list per token}, in the body or on the choice's last streamed chunk.
- An unexpected exception under a request is logged with a request id; the client gets a generic
  500 naming that id, never the exception text.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jvllm.server.formats import (chat_logprobs, clamp_logprob, completion_logprobs, end_offset,
                                  hidden_states_json, prompt_logprobs_json, token_text)
from jvllm.server.protocol import APIError, error_body

log = logging.getLogger("jvllm.server")
_SERVICE_ERRORS = ("EngineDeadError", "DrainingError")


def internal_error_message(e: BaseException, where: str) -> str:
    """Log `e` under a fresh request id; the generic message for the client."""
    rid = "err-" + os.urandom(6).hex()
    log.error("internal error %s in %s", rid, where, exc_info=e)
    return f"internal server error (request id {rid}: the server log has the details)"


class ChoiceState:
    """What has been generated for one choice (accumulated over DELTA outputs)."""

    __slots__ = ("index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason", "started",
                 "finish_sent", "sent_len", "hidden_states", "lp_offset")

    def __init__(self, index: int):
        self.index = index
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason = self.stop_reason = None
        self.started = self.finish_sent = False
        self.sent_len = 0  # characters of content streamed (chat with tools holds a possible call back)
        self.hidden_states = None  # {layer: [n, hidden]} so far (return_hidden_states; every output has all)
        self.lp_offset = None  # completions logprobs streamed: the next token's text_offset


class Collector:
    """Per-HTTP-request state: choices, usage, prompt logprobs."""

    def __init__(self, num_prompts: int, n: int, echo_only: bool = False):
        self.n = n
        self.echo_only = echo_only  # generated tokens are dropped (CompletionServer's echo_only)
        self.choices = [ChoiceState(i) for i in range(num_prompts * n)]
        self.prompt_tokens = [0] * num_prompts
        self.prompt_logprobs: list = [None] * num_prompts
        self.prompt_logprobs_sent = [False] * num_prompts  # streaming: sent once, on the first chunk
        self.completion_tokens = 0

    def add(self, pidx: int, out):
        """Fold one DELTA RequestOutput in; returns [(choice, delta_text, delta_ids, delta_lps, finished_now)]."""
        self.prompt_tokens[pidx] = len(out.prompt_token_ids)
        if out.prompt_logprobs is not None and self.prompt_logprobs[pidx] is None and any(
                len(c.token_ids) for c in out.outputs):
            self.prompt_logprobs[pidx] = out.prompt_logprobs
        deltas = []
        for c in out.outputs:
            ch = self.choices[pidx * self.n + c.index]
            if ch.finish_sent:
                continue
            if self.echo_only:
                c = dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None)
            ch.text.append(c.text)
            ch.token_ids.extend(c.token_ids)
            if c.hidden_states is not None:
                ch.hidden_states = c.hidden_states
            if c.logprobs:
                ch.logprobs.extend(c.logprobs)
            self.completion_tokens += len(c.token_ids)
            finished_now = c.finish_reason is not None
            if finished_now:
                ch.finish_reason, ch.stop_reason, ch.finish_sent = c.finish_reason, c.stop_reason, True
            if c.text or c.token_ids or finished_now:
                deltas.append((ch, c.text, list(c.token_ids), list(c.logprobs or []), finished_now))
        return deltas

    def usage(self) -> dict:
        p = sum(self.prompt_tokens)
        return {"prompt_tokens": p, "completion_tokens": self.completion_tokens,
                "total_tokens": p + self.completion_tokens}


# ---------------------------------------------------------------------- driving a submission
async def watch_disconnect(request: Request, coro):
    """Run `coro` (a non-streamed handler body) but cancel it as soon as the client disconnects
    (its finally blocks then abort the engine requests). Returns coro's result, or an empty 499
    response (never seen by anyone) when the client went away."""
    task = asyncio.ensure_future(coro)

    async def wait_gone():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        try:
            await task
        except BaseException:
            pass
        return Response(status_code=499)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _error_event(e: BaseException) -> str:
    if type(e).__name__ in _SERVICE_ERRORS:
        return _sse(error_body(str(e) or type(e).__name__, 503))
    return _sse(error_body(internal_error_message(e, "a stream"), 500))


class _SubmissionStream(StreamingResponse):
    """Closes its Submission however the response ends, even if the body generator never started
    (a client that disconnects before the first byte: starlette then never iterates it)."""

    def __init__(self, sub, *a, **kw):
        super().__init__(*a, **kw)
        self.sub = sub

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.sub.close()


class CompletionServer:
    """Formats /v1/completions (chat=False) or /v1/chat/completions (chat=True) answers."""

    def __init__(self, chat: bool, model: str, n: int, num_prompts: int, prompts, stream: bool,
                 include_usage: bool, top_logprobs: int | None, echo: bool = False, decode=None,
                 continuous_usage: bool = False, tool_mode=None, echo_only: bool = False):
        """`echo_only` (completions, echo with max_tokens 0): each choice is its prompt alone; the one
        token the engine ran is not shown or counted."""
        self.chat, self.model, self.stream = chat, model, stream
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompts = prompts
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage
        self.top_logprobs = top_logprobs
        self.echo = echo
        self.decode = decode  # token ids -> text (the first echoed token has no prompt logprob entry)
        self.col = Collector(num_prompts, n, echo_only)
        self.tool_mode = tool_mode  # tools.ToolMode of a chat request whose output may be tool calls
        self._tool_streams: dict = {}  # choice index -> tool_stream.ToolCallStream (streamed chat with tools)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -------------------------------------------------------------- non-streamed
    async def full(self, sub) -> JSONResponse:
        try:
            async for pidx, out in sub:
                self.col.add(pidx, out)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # engine died / shut down under this request
            if type(e).__name__ in _SERVICE_ERRORS:
                raise APIError(str(e), status=503) from None
            raise APIError(internal_error_message(e, "a request"), status=500) from None
        finally:
            sub.close()
        choices = []
        for ch in self.col.choices:
            text = "".join(ch.text)
            pidx = ch.index // self.col.n
            if self.chat:
                msg = {"role": "assistant", "content": text}
                fr = ch.finish_reason
                if self.tool_mode is not None:
                    content, calls = self.tool_mode.parse(text)
                    msg = {"role": "assistant", "content": content, "tool_calls": [t.as_openai() for t in calls]}
                    fr = self.tool_mode.finish_reason(fr, bool(calls))
                c = {"index": ch.index, "message": msg,
                     "logprobs": chat_logprobs(ch.token_ids, ch.logprobs, self.top_logprobs)
                     if self.top_logprobs is not None else None,
                     "finish_reason": fr, "stop_reason": ch.stop_reason}
            else:
                prefix = (self.prompts[pidx].text or "") if self.echo else ""
                lp = None
                if self.top_logprobs is not None:
                    echo = self.echo_logprobs(pidx) if self.echo else None
                    lp = completion_logprobs(ch.token_ids, ch.logprobs, end_offset(echo) if echo else 0)
                    if echo:
                        lp = {k: v + lp[k] for k, v in echo.items()}
                c = {"index": ch.index, "text": prefix + text, "logprobs": lp,
                     "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason,
                     "prompt_logprobs": prompt_logprobs_json(self.col.prompt_logprobs[pidx])}
            if ch.hidden_states is not None:
                c["hidden_states"] = hidden_states_json(ch.hidden_states)
            choices.append(c)
        body = self._head("chat.completion" if self.chat else "text_completion")
        body["choices"] = choices
        body["usage"] = self.col.usage()
        if self.chat:
            body["prompt_logprobs"] = prompt_logprobs_json(self.col.prompt_logprobs[0])
        return JSONResponse(body)

    def echo_logprobs(self, pidx: int) -> dict:
        """Completion-format logprobs of prompt `pidx`'s tokens (top entries up to top_logprobs)."""
        p = self.prompts[pidx]
        plp = self.col.prompt_logprobs[pidx] or []
        tokens, tlps, tops, offs, off = [], [], [], [], 0
        for i, tid in enumerate(p.token_ids):
            e = plp[i] if i < len(plp) else None
            lp = e.get(tid) if e else None
            s = lp.decoded_token if lp is not None and lp.decoded_token is not None else None
            if s is None:
                s = (self.decode([tid]) if self.decode else None) or f"token_id:{tid}"
            tokens.append(s)
            tlps.append(clamp_logprob(lp.logprob) if lp is not None else None)
            tops.append(None if e is None else {
                token_text(v, k): clamp_logprob(v.logprob) for k, v in e.items()
                if k == tid or (v.rank is not None and v.rank <= self.top_logprobs)})
            offs.append(off)
            off += len(s)
        return {"tokens": tokens, "token_logprobs": tlps, "top_logprobs": tops, "text_offset": offs}

    # -------------------------------------------------------------- streamed
    def streaming_response(self, sub) -> StreamingResponse:
        return _SubmissionStream(sub, self._events(sub), media_type="text/event-stream", headers=SSE_HEADERS)

    def _chunk(self, choices, ch: ChoiceState, completion_tokens: int | None = None) -> dict:
        """One event's body for choice `ch`; with continuous usage stats, its usage counts that
        choice as vLLM's does: its prompt's tokens and `completion_tokens` (default: the choice's
        tokens so far; 0 on the role / echo chunk)."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = choices
        if self.include_usage:
            body["usage"] = None
            if self.continuous_usage:
                p = self.col.prompt_tokens[ch.index // self.col.n]
                c = len(ch.token_ids) if completion_tokens is None else completion_tokens
                body["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        return body

    def _choice_delta(self, ch: ChoiceState, text, ids, lps, finished_now) -> dict:
        fr = ch.finish_reason if finished_now else None
        sr = ch.stop_reason if finished_now else None
        if self.chat and self.tool_mode is not None:
            delta, fr = self._tool_delta(ch, finished_now, fr)
            lp = chat_logprobs(ids, lps, self.top_logprobs) if self.top_logprobs is not None and ids else None
            return {"index": ch.index, "delta": delta, "logprobs": lp, "finish_reason": fr, "stop_reason": sr}
        if self.chat:
            delta = {"content": text}
            lp = chat_logprobs(ids, lps, self.top_logprobs) if self.top_logprobs is not None and ids else None
            return {"index": ch.index, "delta": delta, "logprobs": lp, "finish_reason": fr, "stop_reason": sr}
        lp = None
        if self.top_logprobs is not None:
            if ch.lp_offset is None:
                ch.lp_offset = end_offset(self.echo_logprobs(ch.index // self.col.n)) if self.echo else 0
            lp = completion_logprobs(ids, lps, ch.lp_offset)
            ch.lp_offset = end_offset(lp, ch.lp_offset)
        return {"index": ch.index, "text": text, "logprobs": lp, "finish_reason": fr, "stop_reason": sr}

    def _tool_delta(self, ch: ChoiceState, finished_now: bool, fr):
        """(delta, finish_reason) of a chat choice with tools (`tool_stream.ToolCallStream`):
        content until a call may begin, then each call's name and argument chunks as they come;
        finish_reason "tool_calls" when the finished output parses into calls."""
        from jvllm.server.tool_stream import ToolCallStream

        st = self._tool_streams.get(ch.index)
        if st is None:
            st = self._tool_streams[ch.index] = ToolCallStream(self.tool_mode)
        delta, called = st.feed("".join(ch.text), finished_now)
        return delta, self.tool_mode.finish_reason(fr, called)

    def _first_chunks(self, pidx: int) -> list[str]:
        """The role chunk (chat) or the echo chunk (completions) of each choice not started yet. With
        logprobs, an echo chunk waits until the prompt logprobs are in (they come with the first
        generated token) or the choice ended."""
        events = []
        plp_wait = self.top_logprobs is not None and self.col.prompt_logprobs[pidx] is None
        for ch in self.col.choices[pidx * self.col.n:(pidx + 1) * self.col.n]:
            if ch.started:
                continue
            if self.chat:
                ch.started = True
                events.append(_sse(self._chunk([{"index": ch.index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}], ch, 0)))
            elif self.echo and self.prompts[pidx].text:
                if plp_wait and not ch.token_ids and not ch.finish_sent:
                    continue
                ch.started = True
                lp = self.echo_logprobs(pidx) if self.top_logprobs is not None else None
                events.append(_sse(self._chunk([{"index": ch.index, "text": self.prompts[pidx].text,
                                                 "logprobs": lp, "finish_reason": None}], ch, 0)))
            else:
                ch.started = True
        return events

    async def _events(self, sub):
        try:
            try:
                async for pidx, out in sub:
                    deltas = self.col.add(pidx, out)
                    events = self._first_chunks(pidx)
                    plp = self.col.prompt_logprobs[pidx]
                    for d in deltas:
                        c = self._choice_delta(*d)
                        if d[-1] and d[0].hidden_states is not None:  # the choice's last chunk
                            c["hidden_states"] = hidden_states_json(d[0].hidden_states)
                        if plp is not None and not self.chat and not self.col.prompt_logprobs_sent[pidx]:
                            self.col.prompt_logprobs_sent[pidx] = True
                            c["prompt_logprobs"] = prompt_logprobs_json(plp)
                        events.append(_sse(self._chunk([c], d[0])))
                    for ch, *_ in deltas:
                        if ch.finish_reason == "error":
                            events.append(_sse(error_body("the engine failed on this request "
                                                          f"(choice {ch.index})", 500)))
                    if events:
                        yield "".join(events)
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as e:  # engine died or the server is shutting down
                yield _error_event(e)
            if self.include_usage:
                body = self._head("chat.completion.chunk" if self.chat else "text_completion")
                body["choices"] = []
                body["usage"] = self.col.usage()
                yield _sse(body)
            yield "data: [DONE]\n\n"
        finally:
            sub.close()
