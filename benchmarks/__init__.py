"""Measurement programs (`make bench`, `bench-vllm`, `bench-lora`, `bench-kernels`, `fp8-accuracy`, `perplexity`;
`serve`: load on an OpenAI-compatible server), run as `python -m benchmarks.NAME` from the repository
root; the shared workload is `benchmarks.workload`."""
