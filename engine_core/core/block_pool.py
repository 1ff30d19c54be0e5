"""The pool of physical KV blocks: ref counts, the free queue in eviction order, the prefix-cache map.

A block is either in use (ref_cnt > 0, held by one or more block tables) or free
(ref_cnt == 0, in the free queue). A free block may still carry a `block_hash`: its KV
stays valid and a later request with the same prefix can take it back (`touch`) until
`get_new_blocks` hands it out for new tokens, which evicts it (drops its hash). The free
queue is in LRU order: the front is evicted first, freed blocks join the tail.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Iterable, NamedTuple


class BlockHash(NamedTuple):
    """Identity of one full block of tokens in its prefix chain.

    `hash_value` chains the parent block's hash (a 128-bit SHA-256 prefix); the block's own
    `token_ids` and `extra_keys` are kept too, so two blocks whose hash values collide but
    whose tokens differ never compare equal and never share KV.
    """

    hash_value: int
    token_ids: tuple[int, ...]
    extra_keys: tuple | None = None


class KVCacheBlock:
    """One physical block: `block_size` token slots of K and V in every layer."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        h = None if self.block_hash is None else hex(self.block_hash.hash_value)[:10]
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class BlockPool:
    """All blocks of one device (GPU or the CPU swap pool), with ref counts and an LRU free queue."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, front = next to evict. OrderedDict gives O(1) removal from the middle (touch).
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0..1); free blocks that still hold cached KV count as free."""
        return 0.0 if self.num_blocks == 0 else 1.0 - self.num_free_blocks / self.num_blocks

    # seam: labs 02, 05 (grader/seams.py)
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the front of the free queue (least recently used first), each
        with ref_cnt 1; a block that still held cached KV is evicted (its hash leaves the map)."""
        if not 0 <= num_blocks <= self.num_free_blocks:
            raise ValueError(f"num_blocks must be in [0, {self.num_free_blocks}] (free blocks), got {num_blocks}")
        out = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    # seam: lab 02 (grader/seams.py)
    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; a block reaching ref_cnt 0 joins the free queue's
        tail, in the order given (so pass them in the order they should be evicted). A block freed
        more often than it is held raises before any ref count changes."""
        blocks = list(blocks)
        drops = Counter(block.block_id for block in blocks)
        for block in blocks:
            if block.ref_cnt < drops[block.block_id]:
                raise ValueError(f"free_blocks: block {block.block_id} is already free "
                                 f"(ref_cnt {block.ref_cnt}, freed {drops[block.block_id]} time(s) here)")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    # seam: lab 05 (grader/seams.py)
    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits: a free cached block leaves the free queue (it is
        in use again, so it cannot be evicted); a block already in use just gains a holder."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding KV for `block_hash` (in use or free-but-cached), or None."""
        return self.cached_blocks.get(block_hash)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash]) -> None:
        """Register full blocks whose KV has been written under their hashes. A block already
        cached keeps its hash; when another block already holds the same hash (two requests
        computed the same prefix at once) the first stays the cached one and this one is not cached."""
        if len(blocks) != len(block_hashes):
            raise ValueError(f"cache_full_blocks: {len(blocks)} blocks but {len(block_hashes)} hashes")
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None or block_hash in self.cached_blocks:
                continue
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def release_all(self, tail_first: Iterable[KVCacheBlock] = ()) -> None:
        """Make every block free, whatever state an interrupted operation left the ref counts, the free
        queue and the hash map in (recovery after a failed step; not a seam). Blocks not yet in the free
        queue join its tail, `tail_first` in that order, then the rest by id. A block keeps its cached
        hash only where the map points at it, so the map and the blocks agree again."""
        for block in [*tail_first, *self.blocks]:
            block.ref_cnt = 0
            if block.block_id not in self.free_queue:
                self.free_queue[block.block_id] = block
        for block in self.blocks:
            if block.block_hash is not None and self.cached_blocks.get(block.block_hash) is not block:
                block.block_hash = None
        for block_hash, block in list(self.cached_blocks.items()):
            if block.block_hash != block_hash:
                del self.cached_blocks[block_hash]

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
