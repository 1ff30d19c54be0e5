"""Model implementations. One family covers Llama 2/3, Mistral, Qwen2 and Qwen3."""
from engine_core.models.attention import AttentionMetadata
from engine_core.models.llama import SUPPORTED_ARCHITECTURES, LlamaArgs, LlamaForCausalLM, load_model

__all__ = ["AttentionMetadata", "LlamaArgs", "LlamaForCausalLM", "SUPPORTED_ARCHITECTURES", "load_model"]
