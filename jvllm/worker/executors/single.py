"""One stage (one device, or one tensor-parallel mesh): the step program, then the sampler."""
from __future__ import annotations

from jvllm.worker.executors.base import Executor, Work


class SingleExecutor(Executor):
    def forward(self, w: Work):
        return self.launch_stage(0, w, w.tok_in)
