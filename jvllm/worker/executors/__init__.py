"""Stage executors: how a micro-batch's programs are launched. One is chosen at runner
construction (`make_executor`); each is one file behind `Executor.launch(work) -> Pending`."""
from __future__ import annotations

from jvllm.worker.executors.base import Executor, MicrobatchResult, Pending, Work  # noqa: F401


def make_executor(runner) -> Executor:
    if runner.multiprocess:
        from jvllm.worker.executors.multiprocess import MultiprocessExecutor

        return MultiprocessExecutor(runner)
    if len(runner.stages) > 1:
        from jvllm.worker.executors.pipeline import PipelineExecutor

        return PipelineExecutor(runner)
    from jvllm.worker.executors.single import SingleExecutor

    return SingleExecutor(runner)
