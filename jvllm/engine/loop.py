"""The engine's step loops, one chosen at construction (`make_loop`), all behind `step()` /
`drain()`:

  SyncLoop       schedule -> run -> read, one step at a time
  AsyncLoop      dispatch step N+1 before reading step N, so the host's scheduling and input
                 building overlap the device's work (requests sampled in N have one pending token,
                 whose id stays on the device and feeds N+1). When N+1 has a row whose sampling
                 needs the host's tokens (a grammar's mask, penalties, logits processors), N+1 is
                 dispatched `late`: its forward first, then N is read (grammars advance by N's
                 kept tokens), then N+1's sampling inputs are built and its sampler enqueued, so
                 that host work runs while N+1's forward does (`_read_then_sample`)
  PipelinedLoop  async with pipeline stages: one scheduler step per micro-batch, each micro-batch
                 with its own step in flight (vLLM's virtual engines, over one scheduler and one KV
                 pool), so the host's work on micro-batch a's results overlaps the stages' work on b

A dispatched step is a `StepHandle`. Multi-process runs may use the async loops: their decisions
depend only on the order of steps (schedule N+1 from the counts as if N were done, then read N),
never on timing or device readiness, so every process takes the same ones.
"""
from __future__ import annotations

import collections
import dataclasses
import time


@dataclasses.dataclass
class StepHandle:
    """One scheduled step: launched (`run` is the runner's handle), failed to launch (`error`), or
    nothing to run (`sched` None, `outputs` ready now)."""
    sched: object = None              # SchedulerOutput
    run: object = None                # the runner's StepHandle while the step is in flight
    error: BaseException | None = None
    outputs: list = dataclasses.field(default_factory=list)
    late: bool = False                # forward enqueued, sampler not yet (LLMEngine.launch_late)

    @property
    def launched(self) -> bool:
        return self.run is not None


class SyncLoop:
    def __init__(self, engine):
        self.e = engine

    def step(self) -> list:
        return self.e.step_collect(self.e.step_dispatch())

    def drain(self) -> list:
        return []

    def in_flight(self) -> int:
        return 0


def _read_then_sample(e, prev: StepHandle, nxt: StepHandle | None) -> list:
    """Read `prev`, then enqueue the sampler of `nxt` if it is late (its forward is in flight):
    the host time of both, less the wait for `prev`'s results, is `overlap_host_seconds`."""
    if nxt is None or not nxt.late:
        return e.step_collect(prev)
    t0, w0 = time.perf_counter(), e.stats["device_wait_seconds"]
    try:
        outs = e.step_collect(prev)
    finally:  # `nxt` must get its sampler whatever happened here (a later read or step waits on it)
        t1 = time.perf_counter()
        e.launch_late(nxt)
    t2 = time.perf_counter()
    e.stats["host_seconds"] += t2 - t1
    e.stats["overlap_host_seconds"] += (t2 - t0) - (e.stats["device_wait_seconds"] - w0)
    e.stats["num_late_steps"] += 1
    return outs


class AsyncLoop(SyncLoop):
    def __init__(self, engine):
        super().__init__(engine)
        self._inflight: StepHandle | None = None

    def step(self) -> list:
        e = self.e
        prev, self._inflight = self._inflight, None
        if prev is None:
            prev = e.step_dispatch()
        if prev.launched:
            t0 = time.perf_counter()
            self._inflight = e.dispatch_ahead(prev)
            e.stats["host_seconds"] += time.perf_counter() - t0
            e.stats["num_ahead_steps"] += self._inflight is not None
        return _read_then_sample(e, prev, self._inflight)

    def drain(self) -> list:
        prev, self._inflight = self._inflight, None
        return self.e.step_collect(prev) if prev is not None else []

    def in_flight(self) -> int:
        return int(self._inflight is not None)


class PipelinedLoop(SyncLoop):
    """A call first dispatches a step for every micro-batch that has none in flight, then takes the
    oldest step in flight, dispatches its micro-batch's next step ahead of it and reads it. Steps
    are dispatched and read in the same order in every process (stages over processes)."""

    def __init__(self, engine, num_microbatches: int):
        super().__init__(engine)
        self.num_microbatches = num_microbatches
        self.queue: collections.deque[StepHandle] = collections.deque()

    def step(self) -> list:
        e, q = self.e, self.queue
        t0 = time.perf_counter()
        outs = []
        busy = {h.sched.microbatch for h in q}
        for g in range(self.num_microbatches):
            if g in busy:
                continue
            h = e.dispatch(only=g, allow_preempt=not q)
            if h.sched is None:
                outs += h.outputs
            else:
                q.append(h)  # a step, or an error its read reports
        e.stats["host_seconds"] += time.perf_counter() - t0
        if not q:
            return outs
        prev = q.popleft()
        nxt = None
        if prev.launched:
            t0 = time.perf_counter()
            nxt = e.dispatch_ahead(prev, only=prev.sched.microbatch)
            if nxt is not None:
                q.append(nxt)
                e.stats["num_ahead_steps"] += 1
            e.stats["host_seconds"] += time.perf_counter() - t0
        return outs + _read_then_sample(e, prev, nxt)

    def drain(self) -> list:
        outs = []
        while self.queue:
            outs += self.e.step_collect(self.queue.popleft())
        return outs

    def in_flight(self) -> int:
        return len(self.queue)


def make_loop(engine, async_scheduling: bool, num_microbatches: int) -> SyncLoop:
    if not async_scheduling:
        return SyncLoop(engine)
    if num_microbatches > 1:
        return PipelinedLoop(engine, num_microbatches)
    return AsyncLoop(engine)
