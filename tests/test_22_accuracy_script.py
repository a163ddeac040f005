"""benchmarks/quant/accuracy.py end to end on a tiny random Llama and its W8A16 copy: two short windows of a
text file (no download), its table and its JSON. The baseline against itself: Δ 0 and every greedy token equal.
Then a random GPT-2's rows, written by `--prepare`, in process."""

from __future__ import annotations

import json
import math

from conftest import make_llama_checkpoint, run_python

from benchmarks.quant import accuracy
from benchmarks.quant.accuracy import make_windows, parse_row
from tools.models.checkpoints import make_random_checkpoint
from tools.models.quantize_w8a8 import quantize_checkpoint

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 4


def test_rows_and_windows_parse():
    row = parse_row("bf16=some/dir,dtype=bfloat16,max_num_seqs=4,enforce_eager=true")
    assert (row.name, row.model) == ("bf16", "some/dir")
    assert row.kwargs == {"dtype": "bfloat16", "max_num_seqs": 4, "enforce_eager": True}
    assert make_windows(list(range(10)), [99], 4, 5) == [[99, 0, 1, 2], [99, 3, 4, 5], [99, 6, 7, 8]]
    assert make_windows(list(range(3)), [], 8, 2) == [[0, 1, 2]]  # shorter than a window: all of it


def test_accuracy_script_end_to_end(tmp_path):
    fp32, w8a16, text, out = tmp_path / "fp32", tmp_path / "w8a16", tmp_path / "text.txt", tmp_path / "acc.json"
    make_llama_checkpoint(fp32)  # the placeholder tokenizer: one token per byte of TEXT
    quantize_checkpoint(fp32, w8a16, scheme="W8A16")
    text.write_text(TEXT)
    done = run_python("benchmarks/quant/accuracy.py", f"fp32={fp32}", f"w8a16={w8a16}",
                      f"bf16={fp32},dtype=bfloat16,max_num_seqs=2", "--text", str(text), "--windows", "2",
                      "--window", "48", "--prompts", "2", "--prompt-len", "8", "--max-tokens", "12",
                      "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "greedy prefix (of 12)" in done.stdout and "w8a16" in done.stdout

    report = json.loads(out.read_text())
    assert report["command"].startswith("python benchmarks/quant/accuracy.py fp32=")
    assert report["baseline"] == "fp32" and report["text"]["tokens"] == len(TEXT)
    assert (report["text"]["windows"], report["text"]["window_tokens"]) == (2, 48)
    assert report["greedy"] == {"prompts": 2, "prompt_tokens": 8, "max_tokens": 12}
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == ["fp32", "w8a16", "bf16"]
    assert rows["bf16"]["kwargs"] == {"dtype": "bfloat16", "max_num_seqs": 2}
    for r in rows.values():
        assert r["scored_tokens"] == 2 * 47  # every token of a window but its first
        assert math.isclose(r["perplexity"], math.exp(r["mean_nll"])) and r["perplexity"] > 1
        g = r["greedy"]
        assert len(g["ids"]) == 2 and all(len(ids) == 12 for ids in g["ids"]) and g["total_tokens"] == 24
        assert 0 <= g["prefix_mean"] <= 12 and g["equal_pct"] == 100 * g["equal_tokens"] / 24
    base = rows["fp32"]
    assert base["delta_pct"] == 0 and base["greedy"]["prefix_per_prompt"] == [12, 12]
    assert base["greedy"]["equal_pct"] == 100
    assert abs(rows["w8a16"]["delta_pct"]) < 5  # int8 weights move a random model's perplexity by a little


def test_gpt2_w8a8_and_w8a16_rows(tmp_path, monkeypatch, capsys):
    fp32, text, out = make_random_checkpoint(tmp_path / "gpt2"), tmp_path / "text.txt", tmp_path / "acc.json"
    monkeypatch.setattr(accuracy, "QUANT_DIR", tmp_path / "quant")
    assert accuracy.main(["--prepare", str(fp32)]) == 0
    assert "w8a8=" in capsys.readouterr().out
    text.write_text(TEXT)
    rows = [f"fp32={fp32}", f"w8a8={tmp_path / 'quant' / 'gpt2-w8a8'}", f"w8a16={tmp_path / 'quant' / 'gpt2-w8a16'}"]
    assert accuracy.main([*rows, "--text", str(text), "--windows", "1", "--window", "32", "--prompts", "1",
                          "--prompt-len", "8", "--max-tokens", "8", "--json", str(out)]) == 0  # fmt: skip
    report = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(report) == ["fp32", "w8a8", "w8a16"]
    assert all(r["scored_tokens"] == 31 and abs(r["delta_pct"]) < 5 for r in report.values())
