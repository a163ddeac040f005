"""benchmarks/engine/bench_stages.py's report: medians, ranges, and each stage against the one before it round by round.

The measuring half (worktrees, one process per stage and round) runs for half an hour; these tests check what
it writes and how the table and figure are made from that, on made-up measurements.
"""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.engine import bench_stages


def measurements(*tok_s: float) -> list[dict]:
    return [{"tok_s": t, "seconds": 10.0, "passes": 3, "tokens": 3 * 766, "exact": True, "round": r}
            for r, t in enumerate(tok_s)]  # fmt: skip


RUNS = {
    "stage-01-naive-decode": measurements(100, 120, 90),
    "stage-02-kv-cache": measurements(300, 240, 360),  # 3.0x, 2.0x, 4.0x the stage before: median 3.0x, 3 of 3
    "stage-03-offline-scheduler": measurements(270, 264, 324),  # 0.9x, 1.1x, 0.9x: median 0.9x, faster in 1 of 3
    "hf-generate": measurements(200, 150, 250),
}
SPEC = {"output_lens": [32] * 16, "device": "cpu", "min_seconds": 10.0}


def row(table: str, name: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(f"| {name} "))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_table_gives_medians_ranges_and_round_by_round_ratios():
    table = bench_stages.table(RUNS, SPEC, rounds=3)
    assert row(table, "stage-01-naive-decode") == ["stage-01-naive-decode", "100.0", "90.0", "120.0", "-", "-",
                                                   "1.00x", "0.50x"]  # fmt: skip
    assert row(table, "stage-02-kv-cache")[1:6] == ["300.0", "240.0", "360.0", "3.00x", "3/3"]
    assert row(table, "stage-03-offline-scheduler")[4:7] == ["0.90x", "1/3", "2.70x"]
    assert row(table, "hf-generate")[4:] == ["-", "-", "2.00x", "1.00x"]  # HF rows are not "the stage before"


def test_a_stage_after_an_hf_row_is_compared_with_the_last_stage():
    runs = {k: RUNS[k] for k in ("stage-01-naive-decode", "hf-generate", "stage-02-kv-cache")}
    assert row(bench_stages.table(runs, SPEC, rounds=3), "stage-02-kv-cache")[4:6] == ["3.00x", "3/3"]


def test_report_remakes_table_and_figure_from_the_json(tmp_path):
    data = tmp_path / "stages-rounds.json"
    data.write_text(json.dumps({"spec": SPEC, "rounds": 3, "runs": RUNS}))
    plot = tmp_path / "stages.png"
    cmd = [sys.executable, "benchmarks/engine/bench_stages.py", "--report", str(data), "--plot", str(plot)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=bench_stages.REPO).stdout
    assert out.rstrip("\n") == bench_stages.table(RUNS, SPEC, rounds=3)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
