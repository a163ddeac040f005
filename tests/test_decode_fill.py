"""benchmarks/engine/decode_fill.py's count of what decode attention gathers, on `decode_runs`' docstring example."""

from benchmarks.engine.decode_fill import count_step
from roseinfer.attention.sdpa import decode_runs


def test_counts_real_padded_and_split_blocks():
    blocks = [16, 16, 15, 14, 8, 8, 7, 7, 7, 6, 2, 2, 1, 1, 1, 1]  # the docstring's rows, longest first
    seq_lens = [16 * b - 3 for b in blocks]  # each row ends 3 tokens into its last block
    runs = decode_runs(seq_lens, 16)
    assert runs == [(0, 4, 16), (4, 10, 8), (10, 16, 2)]
    rows, real, one_call, gathered, calls = count_step(seq_lens, 16, runs)
    assert (rows, real, calls) == (16, sum(blocks), 3)
    assert one_call == 16 * 16  # every row padded to the longest
    assert gathered == 4 * 16 + 6 * 8 + 6 * 2  # each run padded to its own longest
    assert real <= gathered < one_call
