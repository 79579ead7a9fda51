"""jvllm: a vLLM-style LLM inference engine on JAX/XLA."""
from jvllm.engine.engine_config import EngineConfig
from jvllm.engine.llm_engine import LLMEngine
from jvllm.inputs import TextPrompt, TokensPrompt
from jvllm.llm import LLM
from jvllm.outputs import CompletionOutput, Logprob, RequestOutput
from jvllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestOutputKind", "BeamSearchParams", "TextPrompt", "TokensPrompt", "__version__"]
