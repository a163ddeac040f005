"""benchmarks/engine/bf16_agreement.py's measure: requests equal, and tokens equal before the first difference."""

from __future__ import annotations

import pytest

from benchmarks.engine.bf16_agreement import compare


def test_the_prefix_stops_at_the_first_difference_and_counts_whole_requests():
    a = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10]]
    b = [[1, 2, 9, 4], [5, 6], [0, 8, 9, 10]]  # equal before: 2, all 2, 0 (not 3)
    r = compare(a, b)
    assert (r["equal_requests"], r["requests"], r["tokens"]) == (1, 3, 10)
    assert r["prefix_share"] == pytest.approx(4 / 10)


def test_runs_of_different_lengths_are_refused():
    with pytest.raises(ValueError):
        compare([[1, 2]], [[1, 2], [3]])
    with pytest.raises(ValueError):
        compare([[1, 2]], [[1]])
