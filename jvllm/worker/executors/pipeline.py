"""Pipeline stages in one process: micro-batch by micro-batch, each through all stages, then its
sampler; a stage's hidden states reach the next stage's devices by `jax.device_put` (a
device-to-device copy the next program waits on, never through the host). JAX's async dispatch
then overlaps stage s on micro-batch m with stage s+1 on m-1."""
from __future__ import annotations

import jax

from jvllm.worker.executors.base import Executor, Work


class PipelineExecutor(Executor):
    def forward(self, w: Work):
        stages = self.r.stages
        out = self.launch_stage(0, w, w.tok_in)
        for s_idx in range(1, len(stages)):
            out = self.launch_stage(s_idx, w, jax.device_put(w.x, stages[s_idx].sharding()))
        return out
