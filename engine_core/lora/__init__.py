"""Multi-LoRA serving: adapter requests, PEFT folders, the CPU cache and the GPU slot pool."""
