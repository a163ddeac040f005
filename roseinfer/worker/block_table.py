"""The runner's copy of every request's block table: one row of a [rows, max_blocks] int32 array, kept across steps.

The scheduler's output only says what changed: (j, ids) means "this table, from index j on, is now ids",
which is a new block appended when a decode crosses a block boundary, one replaced block after a
copy-on-write, a shorter table after rejected drafts gave blocks back, or a whole table after a swap-in.
So a step never rebuilds tables from Python lists: it writes the few changed entries, then gathers the
rows of the requests it runs with one numpy indexing operation.

    row 0  │ 7  2  9  ·  · │  num_blocks 3        update (2, [5, 11]) on row 0:  │ 7  2  5 11  · │  4
    row 1  │ 4  ·  ·  ·  · │  num_blocks 1
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, capacity: int, max_blocks_per_req: int, block_size: int):
        self.block_size = block_size
        self.table = np.zeros((capacity, max_blocks_per_req), dtype=np.int32)  # [rows, max_blocks]
        self.num_blocks = np.zeros(capacity, dtype=np.int32)  # [rows]

    def grow(self, capacity: int) -> None:
        table = np.zeros((capacity, self.table.shape[1]), dtype=np.int32)
        table[: len(self.table)] = self.table
        num = np.zeros(capacity, dtype=np.int32)
        num[: len(self.num_blocks)] = self.num_blocks
        self.table, self.num_blocks = table, num

    def set_row(self, row: int, block_ids: list[int]) -> None:
        self.replace_from(row, 0, block_ids)

    def replace_from(self, row: int, start: int, block_ids: list[int]) -> None:
        """Entries start .. of `row` become `block_ids`; the table ends after them."""
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            raise ValueError(f"a block table of {end} blocks does not fit a row of {self.table.shape[1]}")
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def copy_row(self, src: int, dst: int) -> None:
        self.table[dst] = self.table[src]
        self.num_blocks[dst] = self.num_blocks[src]
