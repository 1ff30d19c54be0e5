"""Executors: how the engine runs the model, in its own process or in worker processes."""
