"""The KV cache manager: the block tables of every sequence over a fixed pool of KV blocks. Ids only.

The KV cache is cut into *physical blocks* of `block_size` token slots each. A sequence owns a *block
table*: logical block i (its tokens i·bs … i·bs+bs-1) lives in physical block `table[i]`. Blocks are taken
one at a time as the sequence grows, so a sequence wastes at most `block_size - 1` slots (in its last
block), instead of reserving its whole maximum length up front.

    seq A (37 tokens, bs=16):  table [7, 2, 9]   fill 16 16 5
    seq B (16 tokens):         table [4]         fill 16
    free: 0 1 3 5 6 8 ...

One block id covers *all* layers (as in vLLM): block 7 means "slot range 7 in every layer's K and V".
This class only hands out ids; the tensors they index belong to the model runner's KV cache
(roseinfer/worker/kv_cache.py), which learns the tables from the scheduler's output.

A block may be in several tables at once: prefix caching shares the blocks of a prompt's start, forking
shares a parent's blocks with its children. The physical blocks, their reference counts, hashes and the
LRU free queue live in `roseinfer/core/block_pool.py`; this class decides, per sequence, which blocks
to share, take, copy before a write (copy-on-write), register and give back.

    seq A "You are a poet. Write about the sea"   table [7, 2, 9]     block 7 ref 2, block 2 ref 2
    seq B "You are a poet. Write about a rose"    table [7, 2, 4]     (the first 32 tokens are equal)

A second pool of `num_cpu_blocks` blocks lives in host memory (a `BlockPool` of its own). `swap_out` moves
sequences' tables from device blocks to host blocks, `swap_in` back; each returns the (from, to) block
pairs whose K/V the runner copies before the next forward. Blocks the sequences share get one copy:

    swap_out(["r", "r#1"])   device tables r [7, 2, 9]  r#1 [7, 2, 4]   ->  host r [0, 1, 2]  r#1 [0, 1, 3]
                             pairs (7, 0) (2, 1) (9, 2) (4, 3): 4 blocks move, not 6

The runner keeps its own copy of every table, so each call that changes a table says what it did, as vLLM's
`allocate_slots` does: a `KVCacheBlocks` with the blocks it took, the table index from which the table
changed, and the copy-on-write pairs. The scheduler puts the copies into the step it is building and its
runner view (roseinfer/core/sched/runner_view.py) remembers the change until the request is next scheduled,
when the runner gets just the table's changed tail: one new block id when a decode crosses a block boundary,
nothing at all for most steps. This class keeps no record of what anyone has been told.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from roseinfer.core.block_pool import BlockPool, FreeBlockQueue


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """What one `allocate_slots` or `trim` did to a sequence's block table (vLLM's KVCacheBlocks).

        decode into its own block                  KVCacheBlocks()                              (most steps)
        decode crosses into a new block            new_block_ids (12,)   changed_from 3
        decode writes into a block a fork shares   new_block_ids (5,)    changed_from 2   copies ((9, 5),)
        trim gives back 2 of 5 blocks              new_block_ids ()      changed_from 3

    The scheduler moves `copies` into the step it is building and gives `changed_from` to its runner view."""

    new_block_ids: tuple[int, ...] = ()  # blocks taken from the free queue (a copy-on-write copy included)
    changed_from: int | None = None  # the first table index whose block changed (None: the table is as it was)
    copies: tuple[tuple[int, int], ...] = ()  # copy-on-write (src, dst): dst gets src's K/V before the forward


NO_CHANGE = KVCacheBlocks()  # the common decode step: it fits in the blocks the sequence holds


@dataclass(frozen=True)
class BlockStats:
    num_blocks: int
    used_blocks: int
    used_slots: int  # token slots that hold a token's K/V
    block_size: int

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self.used_blocks

    @property
    def allocated_slots(self) -> int:
        return self.used_blocks * self.block_size

    @property
    def utilization(self) -> float:
        """Filled slots / allocated slots (1.0 = no internal fragmentation)."""
        return self.used_slots / self.allocated_slots if self.used_blocks else 1.0

    @property
    def fragmentation(self) -> float:
        """Allocated but empty slots / allocated slots: the waste inside last blocks."""
        return 1.0 - self.utilization


class KVCacheManager:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_prefix_caching: bool = False,
        num_cpu_blocks: int = 0,
        watermark: float = 0.0,
    ):
        """`enable_prefix_caching`: full computed blocks can be shared by later prompts that start alike.
        `num_cpu_blocks`: the host pool for swapped-out sequences; `watermark`: the fraction of the pool that
        admission leaves free (see `allocate_slots`)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"the KV cache pool must hold at least one block, got num_blocks={num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.block_tables: dict[str, list[int]] = {}  # seq id -> physical block ids
        self.num_tokens: dict[str, int] = {}  # seq id -> token slots in use
        self.num_hashed_blocks: dict[str, int] = {}  # seq id -> its first blocks offered to the prefix cache
        self.num_cpu_blocks = num_cpu_blocks
        self.watermark_blocks = int(watermark * num_blocks)  # as vLLM: 1% of a pool of 1,000 blocks keeps 10 free
        self.cpu_pool = BlockPool(num_cpu_blocks)
        self.cpu_tables: dict[str, list[int]] = {}  # swapped-out seq id -> host block ids

    @property
    def free_block_ids(self) -> FreeBlockQueue:
        """Free blocks, least recently freed first (some still hold a cached prefix)."""
        return self.pool.free

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free)

    @property
    def num_used_blocks(self) -> int:
        """Device blocks held by some sequence (O(1), unlike `stats()`, which walks every table)."""
        return self.num_blocks - len(self.pool.free)

    @property
    def num_swap_blocks_used(self) -> int:
        """Host blocks held by swapped-out sequences."""
        return self.num_cpu_blocks - len(self.cpu_pool.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    # ---- growth --------------------------------------------------------------------
    def find_cached_blocks(self, block_hashes: Sequence[bytes], num_tokens: int) -> list[int]:
        """The longest run of a prompt's first full blocks that the prefix cache holds.

        At most (num_tokens - 1) // block_size blocks: at least one token must still be computed, since
        sampling needs the last token's logits; and a prompt that is exactly k blocks long shares k - 1
        and recomputes the last block in a block of its own (never writing into a shared one)."""
        return self.pool.lookup(block_hashes[: (num_tokens - 1) // self.block_size])

    def allocate_slots(
        self,
        seq_id: str,
        num_new_tokens: int,
        block_hashes: Sequence[bytes] = (),
        cached_blocks: Sequence[int] = (),
        keep_free: int = 0,
        lookahead: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` more tokens (a decode token, drafts to verify, or a prompt chunk),
        taking whole blocks as needed; a sequence seen for the first time gets a new table, which starts with
        `cached_blocks` (a prefix-cache hit, shared, its tokens counted as in use). Returns what it did to the
        table (`KVCacheBlocks`): a new table has changed from index 0 on.

        All or nothing: if the free blocks do not cover the growth, nothing is taken and the answer is None
        (the scheduler then preempts someone, or waits). `block_hashes` are the sequence's full-block hashes:
        blocks that are full once this step has run are offered to the cache. `keep_free` (the watermark at
        admission): succeed only if that many blocks stay free. `lookahead`: blocks for that many more slots
        past the new tokens (a draft model writes its guesses there), not counted as in use."""
        bs, pool = self.block_size, self.pool
        table = self.block_tables.get(seq_id)
        if table is not None and not cached_blocks:
            have = self.num_tokens[seq_id]
            total = have + num_new_tokens
            if (
                total + lookahead <= len(table) * bs
                and (have % bs == 0 or pool.ref_count[table[have // bs]] == 1)
                and (not keep_free or keep_free <= len(pool.free))
            ):  # the common decode step: it fits in the blocks it holds, and the block it writes into is its own
                self.num_tokens[seq_id] = total
                if block_hashes and total // bs > self.num_hashed_blocks[seq_id]:
                    self._cache_full_blocks(seq_id, table, total, block_hashes)
                return NO_CHANGE
        if table is None:
            have, held = len(cached_blocks) * bs, len(cached_blocks)
        elif cached_blocks:
            raise ValueError(f"sequence {seq_id!r} already has blocks: a cached prefix is shared only at admission")
        else:
            have, held = self.num_tokens[seq_id], len(table)
        need = max(0, -(-(have + num_new_tokens + lookahead) // bs) - held)
        # the next token goes into a partly filled block that a forked sibling also holds: copy it first
        write_index = have // bs
        copy_on_write = table is not None and have % bs != 0 and pool.ref_count[table[write_index]] > 1
        reviving = sum(pool.ref_count[b] == 0 for b in cached_blocks) if cached_blocks else 0  # leave the free queue
        if need + reviving + copy_on_write + keep_free > len(pool.free):
            return None
        new_block_ids, changed_from, copies = [], None, ()
        if copy_on_write:  # write into a copy of our own; the siblings keep the original
            fresh = pool.get_free_block()
            copies = ((table[write_index], fresh),)
            pool.free_block(table[write_index])
            table[write_index] = fresh
            new_block_ids.append(fresh)
            changed_from = write_index
        if table is None:
            for block in cached_blocks:  # first, so that taking new blocks cannot evict them
                pool.touch(block)
            table = self.block_tables[seq_id] = list(cached_blocks)
            self.num_hashed_blocks[seq_id] = len(cached_blocks)
            changed_from = 0
        if need:
            if changed_from is None:
                changed_from = len(table)
            grown = [pool.get_free_block() for _ in range(need)]
            table += grown
            new_block_ids += grown
        total = self.num_tokens[seq_id] = have + num_new_tokens
        if block_hashes and total // bs > self.num_hashed_blocks[seq_id]:
            self._cache_full_blocks(seq_id, table, total, block_hashes)
        return KVCacheBlocks(tuple(new_block_ids), changed_from, copies)

    def _cache_full_blocks(self, seq_id: str, table: list[int], total: int, block_hashes: Sequence[bytes]) -> None:
        """Offer the blocks that are full once this step has run to the prefix cache."""
        full = min(total // self.block_size, len(block_hashes))
        for i in range(self.num_hashed_blocks[seq_id], full):
            self.pool.cache_block(table[i], block_hashes[i])
        self.num_hashed_blocks[seq_id] = max(full, self.num_hashed_blocks[seq_id])

    def blocks_needed(self, work: Sequence[tuple[str, int]], lookahead: int = 0) -> int:
        """Free blocks that `allocate_slots` takes for these running sequences, one after the other: growth
        plus copy-on-write copies. Of k holders of a shared partly filled block only k - 1 copy it: the last
        one to write finds it private. The scheduler preempts until this many blocks are free."""
        refs: dict[int, int] = {}  # shared blocks seen so far -> holders left
        total, bs, ref_count = 0, self.block_size, self.pool.ref_count
        for seq_id, n in work:
            table, have = self.block_tables[seq_id], self.num_tokens[seq_id]
            total += max(0, -(-(have + n + lookahead) // bs) - len(table))
            if have % bs:
                block = table[have // bs]
                if refs.get(block, ref_count[block]) > 1:
                    refs[block] = refs.get(block, ref_count[block]) - 1
                    total += 1
        return total

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child's table is the parent's, every block shared (reference count + 1). Whichever of them next
        writes into the shared, partly filled last block copies it first (copy-on-write)."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        table = self.block_tables[parent_id]
        for block in table:
            self.pool.touch(block)
        self.block_tables[child_id] = list(table)
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        self.num_hashed_blocks[child_id] = self.num_hashed_blocks.get(parent_id, 0)

    def trim(self, seq_id: str, num_tokens: int, lookahead: int = 0) -> KVCacheBlocks:
        """Keep the first `num_tokens` slots (and blocks for `lookahead` more) and give back the blocks after
        them: the slots of draft tokens the target rejected. Their K/V stay behind in the kept blocks, to be
        overwritten by the next tokens (nothing reads past a sequence's length). Returns what it did: a table
        that lost its tail has changed from the first block it lost on."""
        table = self.block_tables[seq_id]
        if num_tokens > self.num_tokens[seq_id]:
            raise ValueError(f"cannot trim {seq_id!r} to {num_tokens} tokens: it holds {self.num_tokens[seq_id]}")
        self.num_tokens[seq_id] = num_tokens
        keep = self.blocks_for(num_tokens + lookahead)
        if keep >= len(table):
            return NO_CHANGE
        for block in reversed(table[keep:]):
            self.pool.free_block(block)
        del table[keep:]
        return KVCacheBlocks(changed_from=keep)

    # ---- swapping ------------------------------------------------------------------
    def can_swap_out(self, seq_ids: Sequence[str]) -> bool:
        return len(_distinct(self.block_tables[s] for s in seq_ids)) <= len(self.cpu_pool.free)

    def swap_out(self, seq_ids: Sequence[str]) -> list[tuple[int, int]]:
        """Move the sequences' blocks to host blocks and free the device ones. Returns (device, host) pairs."""
        return self._move(seq_ids, self.block_tables, self.pool, self.cpu_tables, self.cpu_pool)

    def can_swap_in(self, seq_ids: Sequence[str], headroom: int = 0) -> bool:
        """Room on the device for the sequences' blocks and `headroom` more (the scheduler asks, as vLLM does,
        for one block per sequence to grow into plus the watermark, unless nothing else runs)."""
        return len(_distinct(self.cpu_tables[s] for s in seq_ids)) + headroom <= len(self.pool.free)

    def swap_in(self, seq_ids: Sequence[str]) -> list[tuple[int, int]]:
        """Move the sequences back onto fresh device blocks. Returns (host, device) pairs. The blocks that come
        back are private: they are not offered to the prefix cache again. Each table is new to the runner (the
        scheduler sends it whole)."""
        return self._move(seq_ids, self.cpu_tables, self.cpu_pool, self.block_tables, self.pool)

    @staticmethod
    def _move(seq_ids, src_tables, src_pool: BlockPool, dst_tables, dst_pool: BlockPool) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}  # src block -> its dst block, in first-seen order
        for seq_id in seq_ids:
            table = src_tables.pop(seq_id)
            for block in table:
                if block in mapping:
                    dst_pool.touch(mapping[block])  # shared in src: shared in dst, one reference per table
                else:
                    mapping[block] = dst_pool.get_free_block()
            dst_tables[seq_id] = [mapping[b] for b in table]
            for block in reversed(table):
                src_pool.free_block(block)
        return list(mapping.items())

    def free(self, seq_id: str) -> None:
        """Give a finished (or failed, or preempted) sequence's blocks back. Unknown ids are ignored.
        Shared blocks only lose a reference; the tail goes first, so it is the first to be reused."""
        for block in reversed(self.block_tables.pop(seq_id, [])):
            self.pool.free_block(block)
        for block in reversed(self.cpu_tables.pop(seq_id, [])):  # a sequence aborted while swapped out
            self.cpu_pool.free_block(block)
        self.num_tokens.pop(seq_id, None)
        self.num_hashed_blocks.pop(seq_id, None)

    def forget_unheld_prefixes(self, blocks) -> None:
        """Drop these blocks from the prefix cache where no table holds them any more: a failed request's blocks,
        whose K/V may never have been written (blocks other requests still hold were computed)."""
        pool = self.pool
        for block in blocks:
            if pool.ref_count[block] == 0 and pool.block_hash[block] is not None:
                pool.uncache(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: later requests compute their K/V again (blocks in use stay)."""
        self.pool.reset()

    # ---- inspection ----------------------------------------------------------------
    def slot(self, seq_id: str, position: int) -> int:
        """The pool slot of token `position` of a sequence: block_id * block_size + offset."""
        return self.block_tables[seq_id][position // self.block_size] * self.block_size + position % self.block_size

    def get_block_table(self, seq_id: str) -> list[int]:
        return list(self.block_tables[seq_id])

    def fill_levels(self, seq_id: str) -> list[int]:
        """Tokens in each of the sequence's blocks, e.g. [16, 16, 5] (0 for a block booked ahead)."""
        n, bs = self.num_tokens[seq_id], self.block_size
        return [max(0, min(bs, n - i * bs)) for i in range(len(self.block_tables[seq_id]))]

    def stats(self) -> BlockStats:
        filled: dict[int, int] = {}  # physical block -> tokens in it (a shared block counts once)
        for seq_id, table in self.block_tables.items():
            for block, n in zip(table, self.fill_levels(seq_id), strict=True):
                filled[block] = max(filled.get(block, 0), n)
        return BlockStats(self.num_blocks, self.num_used_blocks, sum(filled.values()), self.block_size)

    def snapshot(self) -> dict:
        """A copy of the books, for traces and pictures."""
        in_use = {b for t in self.block_tables.values() for b in t}
        return {
            "block_tables": {s: list(t) for s, t in self.block_tables.items()},
            "num_tokens": dict(self.num_tokens),
            "stats": self.stats(),
            "ref_counts": {b: self.pool.ref_count[b] for b in sorted(in_use)},
            "free_queue": list(self.pool.free),  # least recently freed first
            "cached_blocks": sorted(self.pool.cached.values()),  # blocks findable by their prefix's hash
            "cpu_tables": {s: list(t) for s, t in self.cpu_tables.items()},  # swapped out
            "swap_blocks_used": self.num_swap_blocks_used,
        }


def _distinct(tables: Iterable[list[int]]) -> set[int]:
    return {b for t in tables for b in t}
