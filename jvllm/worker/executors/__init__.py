"""Stage executors: how a micro-batch's programs are launched. One is chosen at runner
construction (`make_executor`); each is one file behind `Executor.launch(work) -> Pending`.
Importing this package registers every executor's program kinds (multiprocess: hop, swap)."""
from __future__ import annotations

from jvllm.worker.executors.base import Executor, MicrobatchResult, Pending, Work  # noqa: F401
from jvllm.worker.executors.multiprocess import MultiprocessExecutor
from jvllm.worker.executors.pipeline import PipelineExecutor
from jvllm.worker.executors.single import SingleExecutor


def make_executor(runner) -> Executor:
    if runner.multiprocess:
        return MultiprocessExecutor(runner)
    if len(runner.stages) > 1:
        return PipelineExecutor(runner)
    return SingleExecutor(runner)
