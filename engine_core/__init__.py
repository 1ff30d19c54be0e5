"""A vLLM-style reference inference engine: paged KV cache, continuous batching, chunked prefill."""
from engine_core.config import EngineConfig
from engine_core.engine import LLMEngine
from engine_core.entrypoints.llm import LLM, GenerationError
from engine_core.guard import EngineBusyError
from engine_core.lora.request import LoRARequest
from engine_core.request import RequestOutput, SamplingParams

__all__ = ["EngineBusyError", "EngineConfig", "GenerationError", "LLM", "LLMEngine", "LoRARequest", "RequestOutput",
           "SamplingParams"]
