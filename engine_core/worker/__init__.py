"""The model runner and what it owns: the model, the KV tensors, the sampler, CUDA graphs."""
