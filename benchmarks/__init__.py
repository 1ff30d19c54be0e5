"""Benchmarks run against a live server or engine (python -m benchmarks.NAME)."""
