"""Measurement programs (`make bench`, `bench-vllm`, `bench-lora`, `bench-kernels`, `fp8-accuracy`), run as
`python -m benchmarks.NAME` from the repository root; the shared workload is `benchmarks.workload`."""
