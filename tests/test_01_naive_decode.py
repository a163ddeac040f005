"""Stage 01: our GPT-2 equals Hugging Face's, the tokenizer round-trips, naive decode is greedy-exact."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, hf_greedy, make_random_checkpoint, run_python

from roseinfer import DEFAULT_MODEL, InferenceEngine
from roseinfer.loader import load_model
from roseinfer.tokenizer import Tokenizer


def _hf_logits(model_dir, ids):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits


@pytest.mark.parametrize("safetensors", [True, False], ids=["safetensors", "pytorch_model.bin"])
def test_logits_match_hf_on_random_config(tmp_path, safetensors):
    model_dir = make_random_checkpoint(tmp_path / "m", seed=3, safetensors=safetensors, n_layer=3, n_embd=96)
    ours, _ = load_model(model_dir, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        diff = (ours(torch.tensor(ids)) - _hf_logits(model_dir, ids)).abs().max().item()
    assert diff < 1e-4


def test_logits_match_hf_on_bundled_model(engine):
    ids = [engine.tokenizer.encode(p) for p in ("Romeo.\nBut soft!", "Hamlet.\nTo be, or")]
    n = min(map(len, ids))
    ids = [x[:n] for x in ids]
    with torch.no_grad():
        diff = (engine.model(torch.tensor(ids)) - _hf_logits(DEFAULT_MODEL, ids)).abs().max().item()
    assert diff < 1e-4


def test_bundled_model_size_and_context(engine):
    n_params = sum(p.numel() for p in engine.model.parameters())
    assert 4e6 <= n_params <= 15e6
    assert engine.config.n_positions >= 512
    size = sum(f.stat().st_size for f in __import__("pathlib").Path(DEFAULT_MODEL).iterdir())
    assert size <= 30 * 2**20


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "naïve café — résumé, Ångström",
        "roses 🌹 and masks 🎭",
        "line one\r\nline two\r\n",
        "你好，世界",
        "<|endoftext|> after the end",
        "  leading spaces\tand\ttabs  ",
    ],
)
def test_tokenizer_round_trip(engine, text):
    ids = engine.tokenizer.encode(text)
    assert all(0 <= t < engine.tokenizer.vocab_size for t in ids)
    assert engine.tokenizer.decode(ids) == text


def test_tokenizer_tokens_that_split_a_character(engine):
    tok = engine.tokenizer
    text = "a rose 🌹 is a rose"
    ids = tok.encode(text)
    pieces = [tok.token_bytes(t) for t in ids]
    assert b"".join(pieces) == text.encode("utf-8")

    def valid(b: bytes) -> bool:
        try:
            b.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    assert not all(valid(p) for p in pieces), "the emoji should be split over several byte tokens"
    assert tok.decode(ids) == text


def test_tokenizer_eot_is_special(engine):
    tok = engine.tokenizer
    assert tok.eos_token_id == engine.config.eos_token_id == tok.vocab_size - 1
    assert tok.encode("<|endoftext|>") == [tok.eos_token_id]


def test_tokenizer_missing_gives_clear_error(tmp_path):
    model_dir = make_random_checkpoint(tmp_path / "m")
    (model_dir / "tokenizer.tiktoken").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer found"):
        Tokenizer.from_model_dir(model_dir, vocab_size=4096)


def test_naive_greedy_matches_hf_generate(engine, hf_model):
    for prompt in PROMPTS[:4]:
        ids = engine.tokenizer.encode(prompt)
        assert engine.generate_ids(ids, max_new_tokens=40) == hf_greedy(hf_model, ids, 40), prompt


def test_generate_returns_text_continuation(engine):
    text = engine.generate("Romeo.\n", max_new_tokens=20)
    assert isinstance(text, str) and len(text) > 0
    ids = engine.generate_ids(engine.tokenizer.encode("Romeo.\n"), 20)
    assert text == engine.tokenizer.decode([t for t in ids if t != engine.eos_token_id])


def test_sampling_is_seeded(engine):
    a = engine.generate("Romeo.\n", 24, temperature=1.0, seed=7)
    b = engine.generate("Romeo.\n", 24, temperature=1.0, seed=7)
    c = engine.generate("Romeo.\n", 24, temperature=1.0, seed=8)
    assert a == b and a != c


def test_stops_at_context_limit(tmp_path):
    eng = InferenceEngine(make_random_checkpoint(tmp_path / "m", n_positions=32), device="cpu")
    prompt = list(range(1, 30))
    assert len(eng.generate_ids(prompt, max_new_tokens=50)) <= 32 - 29


def eos_always_checkpoint(path):
    """A checkpoint whose every next-token argmax is EOS: ln_f outputs a constant vector
    (weight 0, bias = the EOS embedding), and the EOS embedding is made long."""
    from safetensors.torch import load_file, save_file

    make_random_checkpoint(path)
    sd = load_file(path / "model.safetensors")
    eos = 4095
    sd["transformer.wte.weight"][eos] = 10 * torch.randn(sd["transformer.wte.weight"].shape[1])
    sd["transformer.ln_f.weight"].zero_()
    sd["transformer.ln_f.bias"].copy_(sd["transformer.wte.weight"][eos])
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_stops_at_eos(tmp_path):
    eng = InferenceEngine(eos_always_checkpoint(tmp_path / "m"), device="cpu")
    assert eng.generate_ids([1, 2, 3], max_new_tokens=10) == [eng.eos_token_id]
    assert eng.generate("Romeo.", max_new_tokens=10) == ""


@pytest.mark.parametrize(
    ("prompt", "kwargs", "exc", "match"),
    [
        ("", {}, ValueError, "empty"),
        ([], {}, ValueError, "empty"),
        ("Romeo.", {"max_new_tokens": -1}, ValueError, "max_new_tokens"),
        ("Romeo.", {"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ("Romeo.", {"temperature": -0.5}, ValueError, "temperature"),
        ([5000], {}, ValueError, "outside the vocabulary"),
        (None, {}, TypeError, "prompt must be"),
        ("the " * 600, {}, ValueError, "context"),
    ],
)
def test_bad_inputs_raise_clear_errors(engine, prompt, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        engine.generate_ids(prompt, **kwargs) if not isinstance(prompt, str) else engine.generate(prompt, **kwargs)


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        InferenceEngine("./no/such/model", device="cpu")


def _run_cli(*args):
    return run_python("-m", "roseinfer.generate", *args)


def test_cli_smoke():
    r = _run_cli("--prompt", "Hamlet.\n", "--max-new-tokens", "8", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hamlet.\n") and len(r.stdout) > len("Hamlet.\n")
    assert "tokens/s" in r.stderr


def test_cli_unknown_hub_id_offline_names_the_id():
    r = _run_cli("--model", "no-such-user/no-such-model", "--max-new-tokens", "4")
    assert r.returncode == 2
    assert "no-such-user/no-such-model" in r.stderr and "Hugging Face Hub" in r.stderr
