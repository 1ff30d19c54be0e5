"""Block tables of requests: allocation, prefix-cache lookup, and GPU <-> CPU swap plans.

A request's block table covers its first `len(table) * block_size` token positions; the
manager only moves block ids around, the model runner copies the KV tensors.
"""
from __future__ import annotations

import hashlib
import pickle
from typing import Sequence

from engine_core.core import kv_eviction, sliding_window
from engine_core.core.block_pool import BlockHash, BlockPool, KVCacheBlock
from engine_core.request import Request

# vLLM's null block: the entry of a table slot whose block was freed (out of the sliding window, or evicted). It
# belongs to no pool and is never handed to the runner: with a window its row keeps the old id there, never read
# (kernels/reference.py); after an eviction the runner gets the kept blocks only (Scheduler._schedule_chunk).
NULL_BLOCK = KVCacheBlock(-1)


# seam: lab 00 (grader/seams.py)
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# seam: lab 05 (grader/seams.py)
def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple | None = None) -> BlockHash:
    """Hash of one full block, chained on its parent block's `hash_value` (None for the first block).

    The chain makes a block's identity its whole prefix: the same 16 tokens after a different
    prefix get a different hash. `extra_keys` (the LoRA id) keeps adapters from sharing KV.
    SHA-256 (first 128 bits) rather than Python's `hash`, so a collision needs a SHA-256 one.
    """
    tokens = tuple(int(t) for t in token_ids)
    digest = hashlib.sha256(pickle.dumps((parent_hash, tokens, extra_keys), protocol=5)).digest()
    return BlockHash(int.from_bytes(digest[:16], "little"), tokens, extra_keys)


def request_extra_keys(request: Request) -> tuple | None:
    return None if request.lora_id is None else (request.lora_id,)


class KVCacheManager:
    """Owns the GPU block pool, the CPU swap pool and every request's block tables."""

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool = False,
                 num_cpu_blocks: int = 0, sliding_window: int | None = None) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
        self.sliding_window = sliding_window
        self.num_skipped_blocks: dict[str, int] = {}  # leading NULL_BLOCK entries of a table (sliding window)
        self.num_evicted_blocks: dict[str, int] = {}  # NULL_BLOCK entries left by evict_blocks (kv_eviction)
        self.block_scores: dict[str, list[float]] = {}  # h2o: accumulated attention per table slot
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks)
        self.cpu_block_pool = BlockPool(num_cpu_blocks)  # never caches: a plain allocator
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_cpu_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a table already registered

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_gpu_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """GPU KV-cache usage, 0..1."""
        return self.block_pool.usage

    @property
    def cpu_usage(self) -> float:
        return self.cpu_block_pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_cpu_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_cpu_blocks.get(request_id, [])]

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first `num_blocks` full blocks (memoised: extended, never recomputed)."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        if len(hashes) < num_blocks:
            tokens = request.all_token_ids
            if num_blocks * self.block_size > len(tokens):
                raise ValueError(f"block_hashes: {num_blocks} full blocks need {num_blocks * self.block_size} "
                                 f"tokens, request {request.request_id!r} has {len(tokens)}")
            extra = request_extra_keys(request)
            bs = self.block_size
            for i in range(len(hashes), num_blocks):
                parent = hashes[-1].hash_value if hashes else None
                hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], extra))
        return hashes[:num_blocks]

    # ---- prefix caching ------------------------------------------------------------------
    # seam: lab 05 (grader/seams.py)
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks from the start of the request, and the tokens
        they cover. Capped at `num_tokens - 1` so the last token is always computed (its logits
        give the next token): a request that is all hits still recomputes its last block."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in self.block_hashes(request, max_blocks):
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks below `num_computed_tokens` (their KV is written)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = min(num_computed_tokens // self.block_size, len(self.req_to_blocks.get(rid, [])))
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request, num_full)
        blocks, hashes = self.req_to_blocks[rid][start:num_full], hashes[start:num_full]
        if rid in self.num_skipped_blocks:  # freed slots (cached before they were freed) are not registered again
            pairs = [(b, h) for b, h in zip(blocks, hashes) if b is not NULL_BLOCK]
            blocks, hashes = [b for b, _ in pairs], [h for _, h in pairs]
        self.block_pool.cache_full_blocks(blocks, hashes)
        self.num_cached_blocks[rid] = num_full

    # ---- allocation ----------------------------------------------------------------------
    # seam: lab 02 (grader/seams.py)
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Grow the request's block table so it covers `num_computed_tokens` + prefix hits +
        `num_new_tokens` positions. Returns the newly allocated blocks (maybe []), or None when
        the free blocks do not suffice, changing nothing: the scheduler then preempts."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        new_computed_blocks = new_computed_blocks or []
        table = self.req_to_blocks.get(request.request_id, [])
        num_tokens = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_needed = cdiv(num_tokens, self.block_size) - len(table) - len(new_computed_blocks)
        # hits that sit in the free queue are counted as free but cannot be handed out as new blocks
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.block_pool.num_free_blocks - num_free_hits:
            return None
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_needed, 0))
        table = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            table.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(table)
        table.extend(new_blocks)
        return new_blocks

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> int:
        """Free the leading blocks of the request's table that no query from `num_computed_tokens` on can see
        (`num_blocks_out_of_window`), putting NULL_BLOCK in their slots so positions keep their table index
        (vLLM's SlidingWindowManager). Returns how many were freed; 0 without a sliding window. Their KV stays
        cached (prefix caching): it is exact for its prefix, as windowed attention depends on the tokens alone."""
        if self.sliding_window is None:
            return 0
        rid = request.request_id
        table = self.req_to_blocks.get(rid)
        if not table:
            return 0
        done = self.num_skipped_blocks.get(rid, 0)
        # module lookups: lab 16's seams reach the engine
        n = min(sliding_window.num_blocks_out_of_window(num_computed_tokens, self.sliding_window, self.block_size),
                len(table))
        if n <= done:
            return 0
        freed = table[done:n]
        table[done:n] = [NULL_BLOCK] * (n - done)
        self.num_skipped_blocks[rid] = n
        self.block_pool.free_blocks(reversed(freed))
        return n - done

    def evict_blocks(self, request: Request, policy: str, budget_blocks: int, num_sink_blocks: int,
                     num_recent_blocks: int) -> int:
        """Token eviction (core/kv_eviction.py) before a step: free the request's full, computed blocks that
        `evict_tokens` drops so that it holds at most `budget_blocks` (its partial last block counted, never
        evicted), NULL_BLOCK in their slots. h2o ranks them by `block_scores`. Returns how many were freed."""
        rid = request.request_id
        table = self.req_to_blocks.get(rid)
        if not table:
            return 0
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        resident = [i for i in range(num_full) if table[i] is not NULL_BLOCK]
        partial = len(table) - num_full  # allocated after the computed blocks: the one being written
        scores = None
        if policy == "h2o":
            held = self.block_scores.get(rid, [])
            scores = [held[i] if i < len(held) else 0.0 for i in resident]
        dropped = kv_eviction.evict_tokens(policy, len(resident), budget_blocks - partial, num_sink_blocks,
                                           num_recent_blocks, scores)
        if not dropped:
            return 0
        freed = [table[resident[j]] for j in dropped]
        for j in dropped:
            table[resident[j]] = NULL_BLOCK
        self.num_evicted_blocks[rid] = self.num_evicted_blocks.get(rid, 0) + len(dropped)
        self.block_pool.free_blocks(reversed(freed))
        return len(dropped)

    def add_block_scores(self, request: Request, scores: Sequence[float]) -> None:
        """Accumulate one step's attention per block of the runner's row (the table's kept blocks, in order)."""
        rid = request.request_id
        table = self.req_to_blocks.get(rid, [])
        held = self.block_scores.setdefault(rid, [])
        if len(held) < len(table):
            held.extend([0.0] * (len(table) - len(held)))
        slots = [i for i, b in enumerate(table) if b is not NULL_BLOCK]
        for i, score in zip(slots, scores):
            held[i] += score

    def free(self, request: Request) -> None:
        """Release the request's GPU and CPU blocks. The table is freed tail first, so the
        request's last blocks (least likely to be shared) are evicted before its prefix."""
        rid = request.request_id
        self.block_scores.pop(rid, None)
        if self.num_skipped_blocks.pop(rid, 0) + self.num_evicted_blocks.pop(rid, 0):
            self.req_to_blocks[rid] = [b for b in self.req_to_blocks[rid] if b is not NULL_BLOCK]
        self.block_pool.free_blocks(reversed(self.req_to_blocks.pop(rid, [])))
        self.cpu_block_pool.free_blocks(self.req_to_cpu_blocks.pop(rid, []))
        self.num_cached_blocks.pop(rid, None)
        self.req_to_block_hashes.pop(rid, None)

    def free_all(self) -> None:
        """Forget every request's blocks: all GPU and CPU blocks free, cached KV still cached. For
        recovery after a failed step, when a table or a ref count may be half-updated (not a seam)."""
        self.block_pool.release_all(b for table in self.req_to_blocks.values() for b in reversed(table)
                                    if b is not NULL_BLOCK)
        self.cpu_block_pool.release_all()
        for table in (self.req_to_blocks, self.req_to_cpu_blocks, self.num_cached_blocks, self.req_to_block_hashes,
                      self.num_skipped_blocks, self.num_evicted_blocks, self.block_scores):
            table.clear()

    # ---- swapping ------------------------------------------------------------------------
    def num_blocks_to_swap(self, request: Request) -> int:
        """Blocks holding written KV (those covering num_computed_tokens): what a swap copies."""
        return cdiv(request.num_computed_tokens, self.block_size)

    def can_swap_out(self, request: Request) -> bool:
        """Room in the CPU pool, and a table with no freed (NULL_BLOCK) slot: such a request is recomputed."""
        return (self.num_blocks_to_swap(request) <= self.cpu_block_pool.num_free_blocks
                and not self.num_skipped_blocks.get(request.request_id)
                and not self.num_evicted_blocks.get(request.request_id))

    # seam: lab 03 (grader/seams.py)
    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's written KV to CPU blocks and free its GPU blocks. Returns the copies
        (gpu_block_id, cpu_block_id) the runner performs before the next forward pass; blocks
        beyond num_computed_tokens (allocated but never written) are freed without a copy."""
        rid = request.request_id
        n = self.num_blocks_to_swap(request)
        gpu_blocks = self.req_to_blocks.get(rid, [])
        if n > len(gpu_blocks) or n > self.cpu_block_pool.num_free_blocks:
            raise ValueError(f"swap_out: request {rid!r} needs {n} CPU blocks; it holds {len(gpu_blocks)} GPU "
                             f"blocks and {self.cpu_block_pool.num_free_blocks} CPU blocks are free")
        cpu_blocks = self.cpu_block_pool.get_new_blocks(n)
        mapping = [(g.block_id, c.block_id) for g, c in zip(gpu_blocks, cpu_blocks)]
        self.block_pool.free_blocks(reversed(self.req_to_blocks.pop(rid, [])))
        self.num_cached_blocks.pop(rid, None)
        self.req_to_cpu_blocks[rid] = cpu_blocks
        return mapping

    def can_swap_in(self, request: Request, num_new_tokens: int = 0) -> bool:
        """True when the free GPU blocks hold the swapped KV plus `num_new_tokens` more positions."""
        need = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return need <= self.block_pool.num_free_blocks

    # seam: lab 03 (grader/seams.py)
    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request's KV back into fresh GPU blocks and free its CPU blocks.
        Returns the copies (cpu_block_id, gpu_block_id), done before the step's forward pass."""
        rid = request.request_id
        cpu_blocks = self.req_to_cpu_blocks.get(rid, [])
        if rid in self.req_to_blocks or len(cpu_blocks) > self.block_pool.num_free_blocks:
            raise ValueError(f"swap_in: request {rid!r} needs {len(cpu_blocks)} GPU blocks, "
                             f"{self.block_pool.num_free_blocks} free (and must hold none)")
        gpu_blocks = self.block_pool.get_new_blocks(len(cpu_blocks))
        mapping = [(c.block_id, g.block_id) for c, g in zip(cpu_blocks, gpu_blocks)]
        self.cpu_block_pool.free_blocks(self.req_to_cpu_blocks.pop(rid))
        self.req_to_blocks[rid] = gpu_blocks
        self.num_cached_blocks[rid] = 0  # fresh copies: registered again as they stay full
        return mapping
