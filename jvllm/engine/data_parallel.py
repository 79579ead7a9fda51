"""Data parallelism: D engine replicas, each with its own weights copy, scheduler and KV pool on its
own slice of devices (`data_parallel_size` x TP x PP devices in all).

How the scheduler is fed: a new request goes to the replica with the fewest unfinished requests
(ties: lowest index), and all n samples of a request stay on one replica (they share its prompt
blocks). `step()` first dispatches one step on every replica that has work, then collects them,
so the replicas' device programs run at the same time while the host post-processes in turn.
The object has LLMEngine's interface, so `LLM` and the server use it unchanged. Host only: device
facts come from the worker module.
"""
from __future__ import annotations

import itertools

from jvllm.engine.engine_config import EngineConfig
from jvllm.engine.llm_engine import LLMEngine


class DataParallelEngine:
    def __init__(self, config: EngineConfig, devices=None):
        from jvllm.worker import worker as device

        d = config.data_parallel_size
        per = config.tensor_parallel_size * config.pipeline_parallel_size * config.expert_parallel_size
        devices = list(devices if devices is not None else device.devices())
        nproc = device.process_count()
        if nproc > 1:
            # every replica is stepped from this process, so its devices must all be local; run one
            # engine per process instead (same requests in every process) or tensor parallelism
            raise ValueError(f"data_parallel_size={d} needs a single-process run (got {nproc} "
                             f"processes); across processes use tensor parallelism (tensor_parallel_size up to "
                             f"{len(devices)})")
        if d * per > len(devices):
            raise ValueError(
                f"data_parallel_size ({d}) x tensor_parallel_size ({config.tensor_parallel_size}) x "
                f"expert_parallel_size ({config.expert_parallel_size}) x "
                f"pipeline_parallel_size ({config.pipeline_parallel_size}) = {d * per} devices, but only "
                f"{len(devices)} are available")
        self.config = config
        self.replicas = [LLMEngine(config, devices=devices[i * per:(i + 1) * per]) for i in range(d)]
        self._warm = False
        self._owner: dict[str, LLMEngine] = {}
        self._ids = itertools.count()

    # --- attributes LLM / the server read
    def __getattr__(self, name):  # tokenizer, model_config, sched_config, eos_token_ids, dtype, ...
        if name == "replicas":
            raise AttributeError(name)
        return getattr(self.replicas[0], name)

    def add_request(self, request_id, prompt, params=None, arrival_time=None) -> str:
        request_id = str(request_id) if request_id is not None else f"dp-{next(self._ids)}"
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        eng = min(self.replicas, key=lambda e: e.get_num_unfinished_requests())
        eng.add_request(request_id, prompt, params, arrival_time)
        self._owner[request_id] = eng
        return request_id

    def abort_request(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            eng = self._owner.pop(rid, None)
            if eng is not None:
                eng.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def get_num_unfinished_requests(self) -> int:
        return sum(e.get_num_unfinished_requests() for e in self.replicas)

    def step(self):
        handles = [(e, e.step_dispatch()) for e in self.replicas if e.has_unfinished_requests()]
        outs = []
        for e, h in handles:
            outs += e.step_collect(h)
        for o in outs:
            if o.finished:
                self._owner.pop(o.request_id, None)
        return outs

    def wait_for_warmup(self, timeout: float | None = None) -> float:
        """Wait for every replica's background warm-up; the process-wide compile counter then
        counts from the end of the last one."""
        secs = max(e.wait_for_warmup(timeout) for e in self.replicas)
        base = self.replicas[0].worker.compile_count()
        for e in self.replicas:
            e.compiles_after_warmup_base = base
        self._warm = True
        return secs

    def warmup_done(self) -> bool:
        """Whether every replica's background warm-up has ended (any thread may ask)."""
        return all(e.warmup_done() for e in self.replicas)

    def get_stats(self) -> dict:
        if not self._warm and self.warmup_done():
            self.wait_for_warmup()
        per = [e.get_stats() for e in self.replicas]
        out = {}
        for k in per[0]:
            vals = [p[k] for p in per]
            if k in ("kv_usage", "prefix_cache_hit_rate"):
                out[k] = sum(vals) / len(vals)
            elif k == "warmup_pending":
                out[k] = any(vals)
            elif k == "compiles_after_warmup":  # one process-wide counter
                out[k] = vals[0]
            else:
                out[k] = sum(vals)
        out["data_parallel_size"] = len(self.replicas)
        return out

    @property
    def init_seconds(self):
        return max(e.init_seconds for e in self.replicas)

    def shutdown(self):
        for e in self.replicas:
            e.shutdown()
