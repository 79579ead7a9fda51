"""AsyncEngine: one background thread owns the (not thread-safe) LLMEngine; asyncio handlers talk
to it through a command queue and get outputs back through per-submission asyncio queues.

Threading contract:
- Only the engine thread calls `engine.add_request / abort_request / step / get_stats`. Handlers
  put commands on a thread-safe queue; the thread drains it between steps, so an abort frees its
  KV blocks before the next step at the latest.
- Outputs of one step are handed to the event loop in one `loop.call_soon_threadsafe` call.
- `Submission` objects (one per HTTP request, holding 1..k engine requests) live on the event
  loop; everything that touches them or the admission counter runs on the loop thread.

Admission ("the queue") counts sequences: an engine request with n choices counts n. At most
`max_num_seqs + max_queue_len` sequences are admitted at a time; the first `max_num_seqs` can
run, the rest wait, and a submission that would go beyond is refused with `QueueFullError` (HTTP
503 + Retry-After). The count depends only on the order of arrivals and finishes, never on the
engine's timing.

Draining: `begin_drain(timeout)` (SIGTERM) refuses new submissions at once and, `timeout`
seconds later, ends every submission still open with `DrainingError` (aborting its engine
requests), so each handler answers a clean 503 / SSE error event before the HTTP server gives up
on it.

Failure contract: an engine error on one request reaches it as an output with finish_reason
"error" (LLMEngine.step does that). An exception escaping `step()` is an engine bug: the engine is
marked dead, every open submission gets `EngineDeadError`, and /health answers 503.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import AsyncIterator

log = logging.getLogger("jvllm.server")


class EngineDeadError(RuntimeError):
    pass


class QueueFullError(RuntimeError):
    pass


class DrainingError(RuntimeError):
    pass


@dataclasses.dataclass
class _Timing:
    """One engine request, server clock (taken right after the step that produced the tokens);
    choice 0 carries the timing."""

    first: float | None = None  # first generated token
    last: float | None = None  # latest generated token
    tokens: int = 0  # tokens of choice 0 so far
    counted_prefix: bool = False  # prompt counted in the prefix-cache counters


def num_seqs(params) -> int:
    """Sequences one engine request puts in the engine (its admission weight)."""
    return max(int(getattr(params, "n", 1) or 1), int(getattr(params, "best_of", None) or 1))


class Submission:
    """The engine requests of one HTTP request. Iterate `async for idx, out in sub` (idx = prompt
    index) until every request finished; always `close()` (idempotent) in a finally: it aborts the
    unfinished requests in the engine and gives their admission slots back."""

    def __init__(self, aengine: "AsyncEngine", request_ids: list[str], num_seqs: int):
        self._aengine = aengine
        self.request_ids = request_ids
        self.num_seqs = num_seqs
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(request_ids)
        self.arrival = time.time()
        self.timing: dict[str, _Timing] = {rid: _Timing() for rid in request_ids}
        self._closed = False

    def __aiter__(self) -> AsyncIterator:
        return self._iter()

    async def _iter(self):
        while self.unfinished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
            yield self.index[item.request_id], item

    def close(self):
        if self._closed:
            return
        self._closed = True
        if self.unfinished:
            self._aengine.abort(list(self.unfinished))
        self._aengine._release(self)
        self.unfinished.clear()


class AsyncEngine:
    def __init__(self, engine, max_queue_len: int = 512, metrics=None):
        self.engine = engine
        self.max_num_seqs = engine.sched_config.max_num_seqs
        self.capacity = self.max_num_seqs + max_queue_len
        self.metrics = metrics
        self.num_admitted = 0  # sequences; loop thread only
        self.open: set[Submission] = set()  # loop thread only
        self.draining = False
        self.dead: BaseException | None = None
        self.stats: dict = dict(engine.get_stats())  # snapshot, replaced by the engine thread
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "check dead + enqueue" against "die + drain"
        self._subs: dict[str, Submission] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False

    # ------------------------------------------------------------------ lifecycle (loop thread)
    def start(self):
        """Start the engine thread; call from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="jvllm-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 10.0):
        """Stop the engine thread: aborts what is still open; its consumers get DrainingError."""
        self._stop = True
        self._cmds.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    def begin_drain(self, timeout: float):
        """Thread-safe (a signal handler may call it): refuse new submissions now; after `timeout`
        seconds end the open ones with DrainingError."""
        self.draining = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.call_later, max(0.0, timeout), self.expire_open, timeout)

    def expire_open(self, timeout: float | None = None):
        """Loop thread: end every open submission with DrainingError and abort its engine requests."""
        why = "the server shut down before the request finished" + (
            f" (--drain-timeout {timeout:g} s passed)" if timeout is not None else "")
        for sub in list(self.open):
            if sub.unfinished:
                self.abort(list(sub.unfinished))
            sub.queue.put_nowait(DrainingError(why))

    def dead_message(self) -> str:
        """What clients learn about a dead engine: its error's type only (the log has the rest)."""
        if self.dead is None:
            return "the engine thread stopped (the server log has the details)"
        return f"the engine is dead ({type(self.dead).__name__}; the server log has the details)"

    @property
    def alive(self) -> bool:
        return self.dead is None and (self._thread is None or self._thread.is_alive() or self._stop)

    @property
    def warmup_pending(self) -> bool:
        """True while the engine's background warm-up still compiles (read live, not from the
        `stats` snapshot, which an idle engine thread does not refresh)."""
        return not self.engine.warmup_done()

    # ------------------------------------------------------------------ requests (loop thread)
    async def submit(self, items: list[tuple[str, object, object]]) -> Submission:
        """Admit and queue [(request_id, prompt, SamplingParams)] all-or-nothing. Raises
        QueueFullError / DrainingError / EngineDeadError, or the engine's ValueError/TypeError."""
        if self.draining:
            raise DrainingError("the server is shutting down")
        if not self.alive:
            raise EngineDeadError(self.dead_message())
        seqs = sum(num_seqs(sp) for _, _, sp in items)
        if seqs > self.capacity:
            field = "n" if seqs > len(items) else "prompt"
            raise ValueError(f"{field}: {len(items)} prompt(s) x n make {seqs} sequences, which can never be "
                             f"admitted: this server admits at most {self.capacity} sequences at once "
                             f"(max_num_seqs + max_queue_len)")
        if self.num_admitted + seqs > self.capacity:
            raise QueueFullError(f"the server is full: {self.num_admitted} sequences admitted, this request has "
                                 f"{seqs}, the limit is {self.capacity} (max_num_seqs {self.max_num_seqs} + "
                                 f"max_queue_len {self.capacity - self.max_num_seqs}); retry later")
        sub = Submission(self, [rid for rid, _, _ in items], seqs)
        self.num_admitted += seqs
        self.open.add(sub)
        fut = self._loop.create_future()
        try:
            with self._lock:
                if self.dead is not None:
                    raise EngineDeadError(self.dead_message())
                self._cmds.put(("add", items, sub, fut))
            await fut
        except BaseException:
            sub.unfinished.clear()  # nothing of it is in the engine (or the abort below covers it)
            if not fut.done() or fut.cancelled():
                self.abort(sub.request_ids)  # cancelled while the engine thread may be adding it
            sub.close()
            raise
        return sub

    def abort(self, request_ids: list[str]):
        """Thread-safe, non-blocking: the engine thread aborts them before its next step."""
        self._cmds.put(("abort", list(request_ids)))

    def _release(self, sub: Submission):
        self.num_admitted -= sub.num_seqs
        self.open.discard(sub)
        if sub.unfinished and self.metrics is not None:  # aborted by the server (disconnect, error)
            self.metrics.success.labels(self.metrics.model_name, "abort").inc(len(sub.unfinished))

    # ------------------------------------------------------------------ engine thread
    def _run(self):
        eng = self.engine
        try:
            while not self._stop:
                self._drain(block=not eng.has_unfinished_requests())
                if self._stop:
                    break
                if eng.has_unfinished_requests():
                    outs = eng.step()
                    if outs:
                        self._dispatch(outs)
                self.stats = dict(eng.get_stats())
        except BaseException as e:  # engine bug: the engine is dead, fail everyone
            log.exception("the engine loop died")
            self._die(e)
            return
        # shutdown: abort everything still open, and tell its consumers
        rids = list(self._subs)
        if rids:
            eng.abort_request(rids)
            subs = [self._subs.pop(r) for r in rids]
            self._loop.call_soon_threadsafe(self._deliver_shutdown, subs)

    def _drain(self, block: bool):
        try:
            cmd = self._cmds.get(timeout=0.2) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            self._handle(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd):
        eng = self.engine
        if cmd[0] == "abort":
            alive = [r for r in cmd[1] if self._subs.pop(r, None) is not None]
            if alive:
                eng.abort_request(alive)
            return
        _, items, sub, fut = cmd
        added = []
        try:
            for rid, prompt, params in items:
                eng.add_request(rid, prompt, params, arrival_time=sub.arrival)
                added.append(rid)
        except BaseException as e:
            if added:
                eng.abort_request(added)
            self._loop.call_soon_threadsafe(_set_exc, fut, e)
            return
        for rid in added:
            self._subs[rid] = sub
        self._loop.call_soon_threadsafe(_set_result, fut)

    def _dispatch(self, outs):
        batch = []
        for out in outs:
            sub = self._subs.get(out.request_id)
            if sub is None:
                continue
            if out.finished:
                del self._subs[out.request_id]
            batch.append((sub, out))
        if batch:
            self._loop.call_soon_threadsafe(self._deliver, batch, time.time())

    def _die(self, e: BaseException):
        with self._lock:
            self.dead = e
            pending = []
            while True:
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if cmd is not None and cmd[0] == "add":
                    pending.append(cmd[3])
        err = EngineDeadError(self.dead_message())
        subs = {id(s): s for s in self._subs.values()}.values()
        self._subs.clear()

        def fail():
            for fut in pending:
                _set_exc(fut, err)
            for s in subs:
                s.queue.put_nowait(err)

        try:
            self._loop.call_soon_threadsafe(fail)
        except RuntimeError:  # loop closed
            pass

    # ------------------------------------------------------------------ loop thread callbacks
    def _deliver(self, batch, now: float):
        m = self.metrics
        for sub, out in batch:
            sub.queue.put_nowait(out)
            t = sub.timing[out.request_id]
            k = len(out.outputs[0].token_ids) if out.outputs else 0
            if m is not None and not t.counted_prefix and (k or out.finished):
                t.counted_prefix = True
                m.observe_prefix(len(out.prompt_token_ids), getattr(out, "num_cached_tokens", 0) or 0)
            if k:
                if t.last is not None and m is not None:
                    m.observe_inter_token(now - t.last)
                t.first = now if t.first is None else t.first
                t.last = now
                t.tokens += k
            if out.finished and m is not None:
                reason = out.outputs[0].finish_reason if out.outputs else None
                m.observe_finished(reason, sub.arrival, t.first, t.last, now, t.tokens)

    @staticmethod
    def _deliver_shutdown(subs):
        for sub in subs:
            sub.queue.put_nowait(DrainingError("the server shut down before the request finished"))


def _set_result(fut):
    if not fut.done():
        fut.set_result(None)


def _set_exc(fut, e):
    if not fut.done():
        fut.set_exception(e)
