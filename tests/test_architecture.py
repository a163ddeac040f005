"""The house rules a newcomer can rely on, checked on the source by tools/stages/layers.py: the layers, no
import cycle, every module behind its interface (the engine talks to the core only through its
`EngineCoreClient`), no module over 400 lines. Each rule is also shown to fail on the code it forbids."""

from __future__ import annotations

import ast

import pytest

from tools.stages import layers


@pytest.mark.parametrize("rule", ["check_layers", "check_cycles", "check_the_door", "check_sizes"])
def test_the_house_rules_hold(rule):
    assert getattr(layers, rule)() == []


def test_the_door_catches_a_reach_in():
    bad = ast.parse("eng.scheduler.requests; llm.llm_engine.model_runner.model")
    good = ast.parse("eng.engine_core.engine_core.scheduler.requests; core.kv_cache_manager; eng.get_stats()")
    assert sum(layers.reaches_in(n) for n in ast.walk(bad)) == 2
    assert not any(layers.reaches_in(n) for n in ast.walk(good))
    tree = ast.parse("from roseinfer.core.sched.scheduler import Scheduler")
    assert "roseinfer.core.sched.scheduler.Scheduler" in layers.imports(tree)


def test_the_cycle_check_finds_a_loop(tmp_path, monkeypatch):
    pkg = tmp_path / "roseinfer"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "engine" / "a.py").write_text("from roseinfer.engine.b import x\n")
    (pkg / "engine" / "b.py").write_text("from roseinfer.engine.a import y\n")
    (pkg / "engine" / "c.py").write_text("import roseinfer.engine.a\n")
    monkeypatch.setattr(layers, "REPO", tmp_path)
    monkeypatch.setattr(layers, "PACKAGE", pkg)
    assert layers.check_cycles() == ["cycle: roseinfer.engine.a -> roseinfer.engine.b -> roseinfer.engine.a"]


def test_the_layer_and_size_checks_fail_on_bad_code(tmp_path, monkeypatch):
    pkg = tmp_path / "roseinfer"
    (pkg / "core").mkdir(parents=True)
    (pkg / "core" / "bad.py").write_text("from roseinfer.entrypoints.llm import LLM\n" + "x = 1\n" * 400)
    monkeypatch.setattr(layers, "REPO", tmp_path)
    monkeypatch.setattr(layers, "PACKAGE", pkg)
    assert layers.check_layers() == [
        "layers: roseinfer/core/bad.py imports roseinfer.entrypoints.llm (layer 5 > 2)",
        "layers: roseinfer/core/bad.py imports roseinfer.entrypoints.llm.LLM (layer 5 > 2)",
    ]
    assert layers.check_sizes() == ["size: roseinfer/core/bad.py has 401 lines (at most 400)"]
