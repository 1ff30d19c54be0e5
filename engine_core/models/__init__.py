"""Model implementations: one Llama-family decoder covers Llama 2/3, Mistral, Qwen2 and Qwen3."""
