"""The host-side adapter cache: loaded adapters ready to copy into a GPU slot, so a slot miss
costs a host -> device copy, not a read from disk."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from engine_core.lora.adapter import LoRAAdapter
from engine_core.lora.request import LoRARequest


class LoRACache:
    """At most `capacity` loaded adapters by lora_int_id, least recently used evicted first
    (vLLM's `max_cpu_loras`). A miss loads through `load` (which checks the folder)."""

    def __init__(self, capacity: int, load: Callable[[LoRARequest], LoRAAdapter]) -> None:
        if capacity < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {capacity}")
        self.capacity = capacity
        self._load = load
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.num_loads = 0  # reads from disk, evictions' reloads included

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, read from disk on a miss, kept as the most recently used."""
        adapter = self.load(request)
        self.put(request, adapter)
        return adapter

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The cached adapter, or one read from disk (the loader checks the folder); the cache is
        unchanged, so a request rejected after this check leaves it as it was."""
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is None:
            adapter = self._load(request)
            self.num_loads += 1
        return adapter

    def put(self, request: LoRARequest, adapter: LoRAAdapter) -> None:
        """Keep `request`'s adapter as the most recently used, evicting the least recently used past capacity."""
        self.adapters[request.lora_int_id] = adapter
        self.adapters.move_to_end(request.lora_int_id)
        while len(self.adapters) > self.capacity:
            self.adapters.popitem(last=False)
