"""The engine's errors that cross layers: raised by an executor, handled by the async loop and the server."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot run another step: a worker process failed (the executor stopped every worker), or the
    async loop is shut down. Every later call raises it again; a server answers 503."""
