"""Runnable examples of the engine (`make demo`: `python -m examples.continuous_batching`)."""
