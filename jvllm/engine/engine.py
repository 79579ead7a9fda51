"""Former home of LLMEngine, kept importable: see `jvllm.engine.llm_engine`."""
from jvllm.engine.engine_config import EngineConfig  # noqa: F401
from jvllm.engine.llm_engine import LLMEngine  # noqa: F401
from jvllm.engine.output_processor import RequestGroup  # noqa: F401
