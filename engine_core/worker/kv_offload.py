"""The CPU offload connector: a finished session's KV copied to a CPU tier, brought back for its next turn.

`KVOffloadConnector` runs on the engine thread between steps (one process: the runner's KV cache and the
scheduler's block pool are both here). Its three moments:
- `save_finished(requests)`: a finished request's full blocks (free but still cached on the device) are planned
  by `OffloadTier.save` and copied to the tier on the copy thread; the next forward may overwrite those blocks,
  so `before_forward` waits on the copies' completion events first.
- `prefetch(token_ids)`: the blocks of a prompt that miss the device cache but hit the tier get free device
  blocks (held by the connector) and a copy back, started on the copy thread and overlapped with whatever the
  engine does meanwhile (other requests' steps). Called by `LLMEngine.add_request` and by a client's hint. A
  prefetch is speculative, so it never takes the running requests' next blocks: it leaves `reserve_blocks()` free
  (the blocks each running request needs to write every token it holds plus one more) and skips, counted, the
  blocks beyond that (they are recomputed, or loaded when the request itself arrives).
- `before_schedule(waiting)`: a load a waiting request needs is waited for (its completion event, never a sleep);
  a finished load whose checksum matches registers its blocks in the device prefix cache (free, cached), so
  admission finds them as prefix hits and prefills only the rest. A load that never signals or whose CPU copy
  no longer matches its checksum (a torn copy) is dropped: the blocks are freed unregistered, the entries leave
  the tier, the request recomputes. Nothing unverified is served. When the running requests' reserve is no
  longer free (they grew, or admissions took blocks, while a hint's copy ran), the speculative copies in flight
  are finished first: their blocks cannot be handed out while the copy thread writes them, and once registered
  they are free (cached) blocks, evicted before anything is preempted. A wait of one copy is cheaper than a
  preempted request's recompute.
"""
from __future__ import annotations

import hashlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from engine_core.core.block_pool import BlockHash, KVCacheBlock
from engine_core.core.kv_cache_manager import KVCacheManager, cdiv, hash_block_tokens
from engine_core.core.kv_offload import OffloadTier
from engine_core.request import Request, RequestStatus
from engine_core.worker.kv_cache import KVCache


@dataclass
class Transfer:
    """One batch of block copies on the copy thread; `done` is set when it ended, `ok` says whether it copied."""

    kind: str  # "save" or "load"
    pairs: list[tuple[int, int]]  # save: (gpu_block_id, slot); load: (slot, gpu_block_id)
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    read_checksums: list[bytes] = field(default_factory=list)  # load: each slot's checksum as the thread read it


@dataclass
class PendingLoad:
    transfer: Transfer
    blocks: list[KVCacheBlock]  # device blocks the connector holds (ref_cnt 1) until the copy is checked
    block_hashes: list[BlockHash]
    slots: list[int]
    expected: list[bytes]  # each slot's checksum when its save completed
    held_hits: list[KVCacheBlock]  # the device-cached blocks before them, held so the LRU cannot evict them meanwhile


class OffloadCopier:
    """The tier's tensors ([slot, block_size, kv_heads, head_dim] per layer, K and V) and the copy thread."""

    def __init__(self, kv_cache: KVCache, num_slots: int) -> None:
        pin = kv_cache.key[0].device.type == "cuda"
        shape = (num_slots, *kv_cache.key[0].shape[1:])
        self.kv_cache = kv_cache
        self.key = [torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=pin) for _ in range(kv_cache.num_layers)]
        self.value = [torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=pin) for _ in range(kv_cache.num_layers)]
        self.checksums: dict[int, bytes] = {}  # slot -> checksum of its bytes when its save completed
        self._jobs: queue.Queue[Transfer | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-offload-copy", daemon=True)
        self._thread.start()

    def submit(self, transfer: Transfer) -> Transfer:
        self._jobs.put(transfer)
        return transfer

    def checksum(self, slot: int) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for tensors in (self.key, self.value):
            for t in tensors:
                h.update(t[slot].contiguous().view(torch.uint8).numpy().tobytes())
        return h.digest()

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._copy(job)
                job.ok = True
            except Exception:  # a failed copy is reported through `ok`, never served
                job.ok = False
            job.done.set()

    def _copy(self, job: Transfer) -> None:
        kv = self.kv_cache
        if job.kind == "load":
            job.read_checksums = [self.checksum(slot) for slot, _ in job.pairs]
        for layer in range(kv.num_layers):
            for dev, cpu in ((kv.key[layer], self.key[layer]), (kv.value[layer], self.value[layer])):
                for a, b in job.pairs:
                    if job.kind == "save":
                        cpu[b].copy_(dev[a])
                    else:
                        dev[b].copy_(cpu[a], non_blocking=True)
        if job.kind == "save":
            for _, slot in job.pairs:
                self.checksums[slot] = self.checksum(slot)
        elif kv.key[0].device.type == "cuda":
            torch.cuda.current_stream(kv.key[0].device).synchronize()


def block_chain(token_ids: Sequence[int], num_blocks: int, block_size: int,
                extra_keys: tuple | None) -> list[BlockHash]:
    """The prefix-cache hashes of the first `num_blocks` full blocks of `token_ids`."""
    hashes: list[BlockHash] = []
    for i in range(num_blocks):
        parent = hashes[-1].hash_value if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys))
    return hashes


class KVOffloadConnector:
    """Saves finished requests' full blocks to a CPU tier of `num_bytes` and loads them back for a new prefix."""

    def __init__(self, kv_cache: KVCache, kv_cache_manager: KVCacheManager, num_bytes: int,
                 copy_timeout_s: float = 60.0, running: Callable[[], Iterable[Request]] = tuple) -> None:
        if not kv_cache_manager.enable_caching:
            raise ValueError("kv_offload_bytes > 0 needs enable_prefix_caching=True (the tier is keyed by the "
                             "prefix cache's block hashes)")
        block_bytes = 2 * kv_cache.num_layers * kv_cache.key[0][0].numel() * kv_cache.key[0].element_size()
        if num_bytes < block_bytes:
            raise ValueError(f"kv_offload_bytes must hold at least one block ({block_bytes} bytes), got {num_bytes}")
        self.block_bytes = block_bytes
        self.kvm = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.tier = OffloadTier(num_bytes // block_bytes)
        self.copier = OffloadCopier(kv_cache, self.tier.num_slots)
        self.copy_timeout_s = copy_timeout_s
        self.running = running  # the scheduler's running requests, now (their next blocks are never prefetched into)
        self._saves: list[Transfer] = []
        self._save_of_slot: dict[int, Transfer] = {}  # the last save into each slot
        self._loads: dict[str, list[PendingLoad]] = {}  # by request id ("" for a client hint)
        self.load_wait_s = 0.0  # time steps spent waiting for loads a waiting request needed (prefetch hides it)

    @property
    def counters(self):
        return self.tier.counters

    # ---- after a step: save --------------------------------------------------------------
    def save_finished(self, requests: Iterable[Request]) -> None:
        """Plan and start the copies of the full written blocks of requests that finished normally."""
        pool = self.kvm.block_pool
        for request in requests:
            if request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
                continue
            extra = None if request.lora_id is None else (request.lora_id,)
            hashes = block_chain(request.all_token_ids, request.num_computed_tokens // self.block_size,
                                 self.block_size, extra)
            found: list[tuple[BlockHash, int]] = []
            for h in hashes:  # the chain's blocks still cached on the device, from the first
                block = pool.get_cached_block(h)
                if block is None:
                    break
                found.append((h, block.block_id))
            plan = self.tier.save([h for h, _ in found], [b for _, b in found])
            if plan:
                transfer = self.copier.submit(Transfer("save", plan))
                self._saves.append(transfer)
                for _, slot in plan:
                    self._save_of_slot[slot] = transfer

    def before_forward(self) -> None:
        """Wait for the saves in flight: the step's forward may write into the blocks they read."""
        for transfer in self._saves:
            if not transfer.done.wait(self.copy_timeout_s) or not transfer.ok:
                self._drop_save(transfer)
        self._saves.clear()

    def _drop_save(self, transfer: Transfer) -> None:
        slots = [slot for _, slot in transfer.pairs if self._save_of_slot.get(slot) is transfer]
        self.tier.discard(slots)
        for slot in slots:
            self.copier.checksums.pop(slot, None)

    # ---- a new prompt: prefetch ----------------------------------------------------------
    def reserve_blocks(self) -> int:
        """The free blocks a prefetch must leave: what each running request needs to write every token it holds
        plus one more (its prompt's remaining chunks, or its next decode step). The scheduler has no watermark of
        its own (vLLM v1 neither): this is the one a speculative copy must respect."""
        tables = self.kvm.req_to_blocks
        return sum(max(0, cdiv(r.num_tokens + 1, self.block_size) - len(tables.get(r.request_id, ())))
                   for r in self.running())

    def prefetch(self, token_ids: Sequence[int], lora_id: int | None = None, request_id: str = "") -> int:
        """Start copying back the blocks of `token_ids` that the device cache misses and the tier holds (never the
        last token's block: it is computed for its logits), into free device blocks above `reserve_blocks()`: the
        blocks found beyond that are skipped (`num_prefetch_skipped_blocks`). Returns the number of blocks whose
        copy started."""
        extra = None if lora_id is None else (lora_id,)
        hashes = block_chain(token_ids, (len(token_ids) - 1) // self.block_size, self.block_size, extra)
        pool = self.kvm.block_pool
        first_miss = next((i for i, h in enumerate(hashes) if pool.get_cached_block(h) is None), len(hashes))
        wanted = hashes[first_miss:]
        if not wanted:
            return 0
        for rid, loads in list(self._loads.items()):  # already coming (a hint): the request now waits for it
            for load in loads:
                if load.block_hashes[0] == wanted[0]:
                    if request_id and rid != request_id:
                        loads.remove(load)
                        self._loads.setdefault(request_id, []).append(load)
                        if not loads:
                            del self._loads[rid]
                    return 0
        hits = [pool.get_cached_block(h) for h in hashes[:first_miss]]
        pool.touch(hits)  # the loaded blocks are worthless without their parents: keep these from eviction
        found = self.tier.load(wanted)
        slots = found[:max(0, pool.num_free_blocks - self.reserve_blocks())]
        self.counters.num_prefetch_skipped_blocks += len(found) - len(slots)
        for slot in slots:  # a save into this slot must end before the copy back reads it
            save = self._save_of_slot.get(slot)
            if save is not None and not save.done.wait(self.copy_timeout_s):
                self._drop_save(save)
        expected = [self.copier.checksums.get(slot) for slot in slots]
        slots = slots[:next((i for i, c in enumerate(expected) if c is None), len(slots))]  # saved ones, from the first
        if not slots:
            pool.free_blocks(reversed(hits))
            return 0
        blocks = pool.get_new_blocks(len(slots))
        transfer = self.copier.submit(Transfer("load", [(s, b.block_id) for s, b in zip(slots, blocks)]))
        self._loads.setdefault(request_id, []).append(
            PendingLoad(transfer, blocks, wanted[:len(slots)], slots, expected[:len(slots)], hits))
        return len(slots)

    def before_schedule(self, waiting_ids: Iterable[str]) -> None:
        """Finish the loads: wait for those a waiting request needs, check and register every load that ended."""
        waiting = set(waiting_ids)
        pressed = self.kvm.block_pool.num_free_blocks < self.reserve_blocks()  # running requests need the blocks
        for rid in list(self._loads):
            loads = self._loads[rid]
            for load in loads:
                if (rid in waiting or pressed) and not load.transfer.done.is_set():
                    t0 = time.perf_counter()
                    load.transfer.done.wait(self.copy_timeout_s)
                    self.load_wait_s += time.perf_counter() - t0
            done = [load for load in loads if load.transfer.done.is_set()]
            for load in done:
                self._finish_load(load)
            rest = [load for load in loads if not load.transfer.done.is_set()]
            if (rid in waiting or pressed) and rest:  # never signalled within the timeout: a torn copy
                for load in rest:
                    self._fail_load(load)
                rest = []
            if rest:
                self._loads[rid] = rest
            else:
                del self._loads[rid]

    def _finish_load(self, load: PendingLoad) -> None:
        if not load.transfer.ok or load.transfer.read_checksums != load.expected:
            self._fail_load(load)
            return
        pool = self.kvm.block_pool
        pool.cache_full_blocks(load.blocks, load.block_hashes)
        pool.free_blocks([*reversed(load.blocks), *reversed(load.held_hits)])  # free, cached: prefix hits for admission
        self.counters.num_loaded_blocks += len(load.blocks)

    def _fail_load(self, load: PendingLoad) -> None:
        """Drop a load that cannot be trusted: its device blocks freed unregistered, its entries out of the tier."""
        self.counters.num_failed_loads += len(load.blocks)
        self.kvm.block_pool.free_blocks([*reversed(load.blocks), *reversed(load.held_hits)])
        self.tier.discard(load.slots)
        for slot in load.slots:
            self.copier.checksums.pop(slot, None)

    # ---- recovery and metrics ------------------------------------------------------------
    def reset(self) -> None:
        """After a failed step: let every copy in flight end, and forget the pending loads (their device blocks
        are freed by the scheduler's recovery, which frees every block)."""
        for transfer in [*self._saves, *(p.transfer for loads in self._loads.values() for p in loads)]:
            transfer.done.wait(self.copy_timeout_s)
        self._saves.clear()
        for loads in self._loads.values():
            for load in loads:
                self.tier.discard(load.slots)
                for slot in load.slots:
                    self.copier.checksums.pop(slot, None)
        self._loads.clear()

    def stats(self) -> dict[str, float]:
        c = self.counters
        queries = c.external_prefix_cache_queries
        hit_rate = c.external_prefix_cache_hits / queries if queries else 0.0
        return {"kv_offload_saved_blocks": c.num_saved_blocks, "kv_offload_loaded_blocks": c.num_loaded_blocks,
                "external_prefix_cache_queries": c.external_prefix_cache_queries,
                "external_prefix_cache_hits": c.external_prefix_cache_hits, "kv_offload_hit_rate": hit_rate,
                "kv_offload_collisions": c.num_collisions, "kv_offload_failed_loads": c.num_failed_loads,
                "kv_offload_usage": self.tier.usage, "kv_offload_load_wait_s": self.load_wait_s,
                "kv_offload_prefetch_skipped_blocks": c.num_prefetch_skipped_blocks}

    def to_prometheus(self) -> str:
        """The counters in Prometheus' text format. They count blocks where vLLM's `external_prefix_cache_*` count
        tokens, so they carry the kit's own prefix, not `vllm:`."""
        c = self.counters
        rows = [("inference_labs:kv_offload_queried_blocks", "blocks looked up in the CPU offload tier",
                 c.external_prefix_cache_queries),
                ("inference_labs:kv_offload_hit_blocks", "of them found there", c.external_prefix_cache_hits),
                ("inference_labs:kv_offload_saved_blocks", "blocks copied to the CPU offload tier", c.num_saved_blocks),
                ("inference_labs:kv_offload_loaded_blocks", "blocks copied back and served", c.num_loaded_blocks),
                ("inference_labs:kv_offload_failed_loads", "blocks recomputed instead: a torn copy or a bad checksum",
                 c.num_failed_loads),
                ("inference_labs:kv_offload_collisions", "tier lookups that met another block's hash value",
                 c.num_collisions),
                ("inference_labs:kv_offload_prefetch_skipped_blocks",
                 "tier hits not prefetched: the running requests' reserve of free blocks", c.num_prefetch_skipped_blocks)]
        return "".join(f"# HELP {name} {doc}\n# TYPE {name} counter\n{name} {float(value)}\n"
                       for name, doc, value in rows)

    def shutdown(self) -> None:
        self.copier.shutdown()
