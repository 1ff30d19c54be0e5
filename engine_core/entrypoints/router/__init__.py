"""The router across data-parallel replicas: `python -m engine_core.entrypoints.router --replica URL ...`."""
