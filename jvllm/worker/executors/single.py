"""One stage (one device, or one tensor-parallel mesh): the step program, then the sampler."""
from __future__ import annotations

from jvllm.worker.executors.base import Executor, Pending, Work


class SingleExecutor(Executor):
    def launch(self, w: Work) -> Pending:
        out = self.launch_stage(0, w, w.tok_in)
        return Pending(w.group, self.launch_sample(w, out))
