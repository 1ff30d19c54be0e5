"""Tensor and pipeline parallelism: process groups, the executor, the worker processes."""
