"""The pool of physical KV blocks behind the KV cache manager: free queue, reference counts, prefix cache.

Requests may share blocks. A physical block has

    ref_count   how many block tables hold it (0 = free)
    block_hash  set once the block is full and its K/V are computed: the hash of its tokens *and of
                everything before them*, hash(parent block's hash, this block's token ids)

and the pool keeps a map `cached: hash -> block`. A new prompt whose first blocks hash to entries of
that map can use those blocks instead of computing their K/V again.

Why the parent's hash is in it: a block's K/V depend on every token before it (attention looks
back), not only on its own 16 tokens. "the king" as tokens 16-31 after a Hamlet prompt and after a
Lear prompt are different K/V; chaining the hashes makes block i's hash name the whole prefix
0 .. (i+1)·bs - 1. SHA-256 makes two different prefixes with one hash practically impossible (with
Python's 64-bit `hash()` a collision would silently give a request another prompt's K/V).

A block moves through four states:

                   get_free_block()                 full + computed: cache_block()
      FREE ─────────────────────────────► IN USE ─────────────────────────────► IN USE, CACHED
   (no hash)  ◄─── evicted: popped from        (ref >= 1)                          (ref >= 1, hash)
      ▲            the queue's head, hash                                           │      ▲
      │            dropped                                       last ref dropped  │      │ touch():
      │                                                          (free_block)      ▼      │ a prompt hits it
      └──────────────────────────────────────────────────────── FREE, CACHED (ref 0, hash, in the queue)

The free queue is least-recently-used first: a freed block goes to the tail and keeps its hash, so it
can be revived by a later hit until it reaches the head and is handed out for something else.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """SHA-256 of the parent block's hash (b"" for the first block) and this block's token ids."""
    return hashlib.sha256((parent or b"") + array("q", token_ids).tobytes()).digest()


class FreeBlockQueue:
    """Free block ids, least recently freed first, with O(1) removal from the middle (a cache hit
    revives a free block wherever it is). An ordered dict of block id -> None does all three."""

    def __init__(self, block_ids: Iterable[int] = ()):
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(block_ids)

    def popleft(self) -> int:
        """The least recently freed block."""
        return self._queue.popitem(last=False)[0]

    def append(self, block: int) -> None:
        self._queue[block] = None

    def extend(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self.append(b)

    def remove(self, block: int) -> None:
        del self._queue[block]

    def clear(self) -> None:
        self._queue.clear()

    def __contains__(self, block: int) -> bool:
        return block in self._queue

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[int]:
        return iter(self._queue)


class BlockPool:
    """Hands out, shares, frees and evicts physical blocks; knows nothing about sequences."""

    def __init__(self, num_blocks: int, enable_caching: bool = False):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.free = FreeBlockQueue(range(num_blocks))
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash of a full, computed block -> that block

    def get_free_block(self) -> int:
        """Take the least recently freed block; if it still held a cached prefix, that entry is evicted."""
        block = self.free.popleft()
        if self.block_hash[block] is not None:
            self.uncache(block)
        self.ref_count[block] = 1
        return block

    def touch(self, block: int) -> None:
        """One more table holds this block (a prefix-cache hit); a free cached block leaves the queue."""
        if self.ref_count[block] == 0:
            self.free.remove(block)
        self.ref_count[block] += 1

    def free_block(self, block: int) -> None:
        """One table lets go. At 0 the block is free, at the queue's tail, and keeps its hash."""
        self.ref_count[block] -= 1
        assert self.ref_count[block] >= 0, f"block {block} freed more often than it was taken"
        if self.ref_count[block] == 0:
            self.free.append(block)

    def cache_block(self, block: int, block_hash: bytes) -> None:
        """A full block whose K/V are computed (or will be, by the end of this step's forward) becomes
        findable by its hash. If another block already holds that prefix, this one stays private."""
        if self.enable_caching and block_hash not in self.cached:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash

    def lookup(self, block_hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest cached run of `block_hashes`, from the first on."""
        hits = []
        for h in block_hashes:
            block = self.cached.get(h) if self.enable_caching else None
            if block is None:
                break
            hits.append(block)
        return hits

    def reset(self) -> None:
        """Forget every cached prefix (after a failed forward: registered blocks may hold garbage)."""
        for block in list(self.cached.values()):
            self.uncache(block)

    def uncache(self, block: int) -> None:
        del self.cached[self.block_hash[block]]
        self.block_hash[block] = None
