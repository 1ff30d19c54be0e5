"""The OpenAI-compatible HTTP server: `python -m engine_core.entrypoints.openai --model M --port P`."""
