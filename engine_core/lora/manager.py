"""The worker's LoRA state (vLLM's WorkerLoRAManager): the adapters it knows by id, the host
cache of loaded adapters, the GPU slot pool and the model's slot weights; each step it puts the
step's adapters into slots and builds the rows' slot mapping."""
from __future__ import annotations

import torch

from engine_core.config import ResolvedConfig
from engine_core.core.scheduler_output import ScheduledChunk
from engine_core.lora.adapter import LoRAAdapter, load_adapter
from engine_core.lora.cache import LoRACache
from engine_core.lora.request import LoRARequest
from engine_core.lora.slots import LoRASlotPool
from engine_core.models.attention import AttentionMetadata
from engine_core.models.config import LlamaArgs
from engine_core.models.llama import LlamaForCausalLM
from engine_core.models.lora import FUSED_MODULES, LoRABatch, attach_lora_stacks


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, args: LlamaArgs, config: ResolvedConfig, backend: str) -> None:
        engine = config.engine
        self.args, self.dtype, self.device = args, config.dtype, config.device
        self.backend = backend  # the runner's resolved kernel backend: the SGMV / BGMV ops dispatch on it
        self.max_lora_rank = engine.max_lora_rank
        self.scaling = torch.zeros(engine.max_loras, dtype=torch.float32, device=config.device)
        self.stacks = attach_lora_stacks(model, args, engine.max_loras, engine.max_lora_rank, self.scaling)
        self.cache = LoRACache(engine.max_cpu_loras or engine.max_loras, self._load)
        self.slots = LoRASlotPool(engine.max_loras)
        self.known: dict[int, LoRARequest] = {}  # every adapter id ever added: one id, one folder
        self.request_lora: dict[str, int] = {}  # running requests with an adapter: their slots are pinned

    def check(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, read and checked (or taken from the host cache); ValueError when the folder is
        bad or the id already names another adapter. Changes nothing: see `remember`."""
        known = self.known.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} at "
                             f"{known.lora_path!r}; got {request.lora_name!r} at {request.lora_path!r} (one id, one "
                             f"adapter)")
        return self.cache.load(request)

    def remember(self, request: LoRARequest, adapter: LoRAAdapter) -> None:
        """Keep a checked adapter: its id names its folder from now on, and it joins the host cache."""
        self.known[request.lora_int_id] = request
        self.cache.put(request, adapter)

    def _load(self, request: LoRARequest) -> LoRAAdapter:
        return load_adapter(request, self.args, self.max_lora_rank, self.dtype)

    def prepare(self, chunks: list[ScheduledChunk], meta: AttentionMetadata,
                num_rows: list[int] | None = None) -> LoRABatch | None:
        """Slots for this step's adapters (loading the missing ones) and the rows' mapping, for
        `chunks` in batch order; None when no chunk uses an adapter (the plain base-model path).
        `num_rows`: each chunk's query rows when they are not its num_tokens (draft tokens added)."""
        ids = [c.request.lora_id for c in chunks]
        for c, lora_id in zip(chunks, ids):
            if lora_id is not None:
                self.request_lora[c.request.request_id] = lora_id
        needed = [i for i in ids if i is not None]
        if not needed:
            return None
        # Disk reads first (an adapter evicted from the host cache is read again; its folder may have
        # gone bad since): one that raises leaves the slots as they were.
        adapters = {i: self.cache.get(self.known[i]) for i in needed if i not in self.slots.slot_of}
        for lora_id, slot in self.slots.assign(needed, set(self.request_lora.values())):
            self.load_slot(slot, adapters[lora_id])
        slot_of = self.slots.slot_of
        return LoRABatch.build([-1 if i is None else slot_of[i] for i in ids], num_rows or [c.num_tokens for c in chunks],
                               [c.emits for c in chunks], meta.num_decode_seqs, meta.output_rows is None,
                               self.device, self.backend)

    def load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter's weights into `slot` of every layer's stacks (host -> device)."""
        self.scaling[slot] = adapter.scaling
        for layer, stacks in enumerate(self.stacks):
            for name, stack in stacks.items():
                stack.write(slot, [adapter.weights.get((layer, m)) for m in FUSED_MODULES[name]])

    def forget(self, request_ids: list[str]) -> None:
        """Finished, aborted or preempted requests no longer pin their adapter's slot."""
        for rid in request_ids:
            self.request_lora.pop(rid, None)

    def forget_all(self) -> None:
        """After a step that raised part-way (the engine requeues every request): no pins, and no slot
        trusted to hold its adapter whole (LoRASlotPool.clear)."""
        self.request_lora.clear()
        self.slots.clear()
