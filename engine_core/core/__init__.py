"""Scheduling and KV-cache management: which tokens run each step, and which blocks hold their KV."""
