"""The research lifecycle of an LLMEngine: live weight updates and sleep / wake (issue 23's
`update_weights`, `sleep`, `wake_up`), kept apart from the step loop.

A mixin of `jvllm.engine.llm_engine.LLMEngine`: it uses the engine's `drain`, `runner`,
`kv_manager`, `model_config`, `dtype`, `config`, `loop` and `_warmup`. Host only (no jax import
here; the worker-side work is in `jvllm.worker.weights` and `jvllm.memory.sleep`).
"""
from __future__ import annotations

import dataclasses

from jvllm.outputs import RequestOutput


class WeightsAndSleep:
    _param_specs = None  # built on the first update_weights: tracing the abstract model is not free
    _model_specs = None
    _asleep = None  # jvllm.memory.sleep's record while asleep

    def update_weights(self, weights) -> list[RequestOutput]:
        """Swap in new weights (`jvllm.worker.weights` states the accepted forms and checks).

        Requests in flight: the step(s) already dispatched finish with the old weights and their
        outputs are returned here (empty when none was in flight); unfinished requests go on from
        the next step with the new weights over the KV they already have (computed with the old
        ones). Every prefix-cache entry is forgotten, so no later request reuses stale KV."""
        from jvllm.models import param_specs
        from jvllm.worker.weights import normalize, update_params

        if self._param_specs is None:
            mc = self.model_config
            self._param_specs = param_specs(mc, self.dtype)
            self._model_specs = None if mc.quant is None else param_specs(dataclasses.replace(mc, quant=None), self.dtype)
        from jvllm.models.registry import family_of

        flat = normalize(weights, self._param_specs, self.model_config.tie_word_embeddings, self._model_specs,
                         name_map=family_of(self.model_config.architecture).name_map)
        outs = self.drain()
        update_params(self.runner, flat)
        self.kv_manager.pool.invalidate_prefix_cache()
        return outs

    def sleep(self, level: int = 1) -> int:
        """Free device memory of this idle engine (`jvllm.memory.sleep`); returns the bytes freed."""
        from jvllm.memory import sleep as sleep_mode

        if not self.config.enable_sleep_mode:
            raise ValueError("sleep needs LLM(enable_sleep_mode=True)")
        if self._asleep is not None:
            raise RuntimeError(f"the engine is already asleep (level {self._asleep.level}); call wake_up() first")
        if self.has_unfinished_requests() or self.loop.in_flight():
            raise RuntimeError(f"sleep needs an idle engine; {self.get_num_unfinished_requests()} request(s) "
                               f"unfinished: finish or abort them first")
        self._warmup.wait()  # the background compiles use the pool's shapes, not its buffers; let them end
        self._asleep = sleep_mode.sleep(self.runner, level)
        self.kv_manager.pool.invalidate_prefix_cache()  # the pool's contents are gone
        return self._asleep.freed_bytes

    def wake_up(self):
        from jvllm.memory import sleep as sleep_mode

        if self._asleep is None:
            raise RuntimeError("wake_up: the engine is not asleep")
        sleep_mode.wake_up(self.runner, self._asleep)
        self._asleep = None
