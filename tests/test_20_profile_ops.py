"""benchmarks/engine/profile_ops.py: the op profile of the timed run's work and of its decode steps."""

import json
import sys

from tests.conftest import make_llama_checkpoint


def test_profile_ops_profiles_the_run_and_its_decode_steps(tmp_path, monkeypatch, capsys):
    from benchmarks.engine import profile_ops

    make_llama_checkpoint(tmp_path / "model", max_position_embeddings=256)
    out = tmp_path / "ops.json"
    monkeypatch.setattr(sys, "argv", ["profile_ops.py", "--model", str(tmp_path / "model"), "--threads", "1",
                                      "--top", "40", "--json", str(out)])  # fmt: skip
    profile_ops.main()
    data = json.loads(out.read_text())
    assert data["tok_s"] > 0 and data["threads"] == 1
    for key in ("ops", "ops_run"):
        rows = data[key]
        assert rows and all(r["calls"] > 0 and 0 <= r["share"] <= 1 for r in rows)
        assert sum(r["share"] for r in rows) <= 1 + 1e-9
        assert [r["self_ms"] for r in rows] == sorted((r["self_ms"] for r in rows), reverse=True)
    printed = capsys.readouterr().out
    assert "run (prefill + decode)" in printed and "decode (prompts cached)" in printed
