"""Speculative decoding: the draft proposers (the rejection sampler is the worker's)."""
