"""Stage 01: our GPT-2 equals Hugging Face's, the tokenizer round-trips, greedy decoding is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import PROMPTS, core, greedy_ids, hf_greedy, make_random_checkpoint, run_python

from roseinfer import DEFAULT_MODEL, LLM, SamplingParams
from roseinfer.model_executor.gpt2 import GPT2
from roseinfer.model_executor.loader import load_model, read_model_config
from roseinfer.tokenizer import Tokenizer


def _hf_logits(model_dir, ids):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits


def _load(model_dir) -> GPT2:
    model_dir = Path(model_dir)
    return load_model(model_dir, read_model_config(model_dir), torch.device("cpu"), torch.float32)


@torch.no_grad()
def dense_greedy_tokens(model: GPT2, prompt_ids: list[int], out_ids: list[int]) -> list[int]:
    """What the naive loop (a full dense forward per new token, argmax, no KV cache) picks after
    prompt + out_ids[:i], for every i, from ONE causal dense forward over prompt + out_ids[:-1]:
    `out_ids` is the naive greedy continuation iff this returns `out_ids`."""
    seq = list(prompt_ids) + list(out_ids[:-1])
    logits = model(torch.tensor([seq]))[0, len(prompt_ids) - 1 :]  # [len(out_ids), V]
    return logits.argmax(-1).tolist()


@pytest.fixture(scope="module")
def model(llm):
    """The GPT2 module inside the session LLM (its dense `forward` is the stage 01 model)."""
    return core(llm.llm_engine).model_runner.model


@pytest.mark.parametrize("safetensors", [True, False], ids=["safetensors", "pytorch_model.bin"])
def test_logits_match_hf_on_random_config(tmp_path, safetensors):
    model_dir = make_random_checkpoint(tmp_path / "m", seed=3, safetensors=safetensors, n_layer=3, n_embd=96)
    ours = _load(model_dir)
    ids = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        diff = (ours(torch.tensor(ids)) - _hf_logits(model_dir, ids)).abs().max().item()
    assert diff < 1e-4


def test_logits_match_hf_on_bundled_model(model, tokenizer):
    ids = [tokenizer.encode(p) for p in ("Romeo.\nBut soft!", "Hamlet.\nTo be, or")]
    n = min(map(len, ids))
    ids = [x[:n] for x in ids]
    with torch.no_grad():
        diff = (model(torch.tensor(ids)) - _hf_logits(DEFAULT_MODEL, ids)).abs().max().item()
    assert diff < 1e-4


def test_bundled_model_size_and_context(llm, model):
    n_params = sum(p.numel() for p in model.parameters())
    assert 4e6 <= n_params <= 15e6
    assert llm.llm_engine.config.model_config.hf_config.n_positions >= 512
    size = sum(f.stat().st_size for f in Path(DEFAULT_MODEL).iterdir())
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
def test_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(0 <= t < tokenizer.vocab_size for t in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_tokens_that_split_a_character(tokenizer):
    tok = tokenizer
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


def test_tokenizer_eot_is_special(llm, tokenizer):
    tok = tokenizer
    assert tok.eos_token_id == llm.llm_engine.config.model_config.eos_token_id == tok.vocab_size - 1
    assert tok.encode("<|endoftext|>") == [tok.eos_token_id]


def test_tokenizer_missing_gives_clear_error(tmp_path):
    model_dir = make_random_checkpoint(tmp_path / "m")
    (model_dir / "tokenizer.tiktoken").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer found"):
        Tokenizer.from_model_dir(model_dir, vocab_size=4096)


def test_greedy_matches_hf_generate_and_the_naive_dense_loop(llm, model, tokenizer, hf_model):
    for prompt in PROMPTS[:4]:
        ids = tokenizer.encode(prompt)
        out = greedy_ids(llm, prompt, 40)
        assert out == hf_greedy(hf_model, ids, 40), prompt
        assert dense_greedy_tokens(model, ids, out) == out, prompt


def test_generate_returns_text_continuation(llm, tokenizer):
    out = llm.generate("Romeo.\n", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert isinstance(out.text, str) and len(out.text) > 0
    assert out.text == tokenizer.decode([t for t in out.token_ids if t != tokenizer.eos_token_id])
    assert out.token_ids == greedy_ids(llm, tokenizer.encode("Romeo.\n"), 20)


def test_sampling_is_seeded(llm):
    def text(seed):
        p = SamplingParams(temperature=1.0, max_tokens=24, seed=seed)
        return llm.generate("Romeo.\n", p, use_tqdm=False)[0].text

    a, b, c = text(7), text(7), text(8)
    assert a == b and a != c


def test_stops_at_context_limit(tmp_path):
    llm = LLM(make_random_checkpoint(tmp_path / "m", n_positions=32), device="cpu", num_blocks=16)
    prompt = list(range(1, 30))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50), use_tqdm=False)[0]
    assert 1 <= len(out.token_ids) <= 32 - 29
    assert core(llm.llm_engine).kv_cache_manager.num_used_blocks == 0


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
    llm = LLM(eos_always_checkpoint(tmp_path / "m"), device="cpu", num_blocks=16)
    greedy = SamplingParams(temperature=0, max_tokens=10)
    by_ids = llm.generate([1, 2, 3], greedy, use_tqdm=False)[0]
    assert by_ids.token_ids == [llm.tokenizer.eos_token_id] and by_ids.finish_reason == "stop"
    assert llm.generate("Romeo.", greedy, use_tqdm=False)[0].text == ""


@pytest.mark.parametrize(
    ("prompt", "kwargs", "exc", "match"),
    [
        ("", {}, ValueError, "empty"),
        ([], {}, ValueError, "empty"),
        ("Romeo.", {"max_tokens": -1}, ValueError, "max_tokens"),
        ("Romeo.", {"max_tokens": 0}, ValueError, "max_tokens"),
        ("Romeo.", {"temperature": -0.5}, ValueError, "temperature"),
        ([5000], {}, ValueError, "outside the vocabulary"),
        (None, {}, TypeError, "prompt must be"),
        ("the " * 600, {}, ValueError, "context"),
    ],
)
def test_bad_inputs_raise_clear_errors(llm, prompt, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        llm.generate([prompt], SamplingParams(**kwargs), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("./no/such/model", device="cpu")


def _run_cli(*args):
    return run_python("-m", "roseinfer.entrypoints.generate", *args)


def test_cli_smoke():
    r = _run_cli("--prompt", "Hamlet.\n", "--max-new-tokens", "8", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hamlet.\n") and len(r.stdout) > len("Hamlet.\n")
    assert "tokens/s" in r.stderr


def test_cli_unknown_hub_id_offline_names_the_id():
    r = _run_cli("--model", "no-such-user/no-such-model", "--max-new-tokens", "4")
    assert r.returncode == 2
    assert "no-such-user/no-such-model" in r.stderr and "Hugging Face Hub" in r.stderr
