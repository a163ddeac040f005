"""Real GPT-2 checkpoint directories load offline and match transformers, or are refused clearly.

Every directory is made here: random weights saved by transformers, and a small byte-level
BPE trained with `tokenizers` and written in Hugging Face's layout (vocab.json, merges.txt,
tokenizer.json, tokenizer_config.json). The network is blocked while roseinfer loads them;
every expected answer comes from transformers in the same test.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS, greedy_ids, hf_greedy, make_random_checkpoint, run_python

from roseinfer import DEFAULT_MODEL, LLM, SamplingParams
from roseinfer.model_executor.activations import ACTIVATIONS
from roseinfer.model_executor.loader import load_model, read_model_config, resolve_model_dir
from roseinfer.tokenizer import Tokenizer
from roseinfer.tokenizer.tokenizer import GPT2_URLS

EOT = "<|endoftext|>"
TRICKY = [
    "Hello, world!", " one leading space", "   three leading spaces", "digits 0123456789, 3.14159 and 2024-01-01",
    "new\nlines\n\n\nand\r\nCRLF\n", "tabs\tand  double  spaces  ", "naïve café — résumé, Ångström", "你好，世界",
    "roses 🌹 and masks 🎭", f"a{EOT}b", EOT, f"{EOT}{EOT} twice", "it's they're we'll I'd", " ", "\n", "x",
    "<|im_start|>user\nhello world<|im_end|>", "hello worldhello world", "<|endoftext", "Ġ Ā ł",
]  # fmt: skip
CORPUS = [p * 3 for p in PROMPTS] + [t * 2 for t in TRICKY[:9]] + ["the quick brown fox jumps over the lazy dog " * 4]
GREEDY = SamplingParams(temperature=0, max_tokens=8)
SMALL = dict(n_positions=64, n_embd=32, n_layer=2, n_head=2)


@pytest.fixture(autouse=True)
def private_tiktoken_cache(monkeypatch, tmp_path):
    """tiktoken keeps a copy of every vocab.json / merges.txt it reads: keep them out of /tmp."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))


def _load(model_dir: Path):
    """Our GPT2 of a checkpoint directory, fp32 on the CPU, the way the engine loads it."""
    model_dir = resolve_model_dir(model_dir)
    return load_model(model_dir, read_model_config(model_dir), torch.device("cpu"), torch.float32)


def _hf(model_dir: Path, **kw):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32, **kw).eval()


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = data
        for p in parents:
            node = node[p]
        node[last] = value
    path.write_text(json.dumps(data))


# ---- 1. config.json fields that change the math ------------------------------------------------
@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    """Random weights, large enough (initializer_range 0.5) that greedy text is not one token repeated."""
    return make_random_checkpoint(tmp_path_factory.mktemp("base"), seed=2, initializer_range=0.5, **SMALL)


IMPLEMENTED = [
    {"n_inner": 48},
    {"scale_attn_by_inverse_layer_idx": True},
    {"scale_attn_weights": False},
    {"layer_norm_epsilon": 1e-2},
    {"reorder_and_upcast_attn": True},
    *({"activation_function": name} for name in ACTIVATIONS),
]


@pytest.mark.parametrize("overrides", IMPLEMENTED, ids=["=".join(map(str, *o.items())) for o in IMPLEMENTED])
def test_implemented_config_field_matches_transformers(tmp_path, base_checkpoint, overrides):
    model_dir = tmp_path / "m"
    if "n_inner" in overrides:  # other weight shapes: a checkpoint of its own
        make_random_checkpoint(model_dir, seed=2, initializer_range=0.5, **SMALL, **overrides)
    else:  # the same weights under another config.json
        shutil.copytree(base_checkpoint, model_dir)
        _edit_json(model_dir / "config.json", **overrides)
    eager = {"attn_implementation": "eager"} if "reorder_and_upcast_attn" in overrides else {}  # only eager honours it
    hf_model = _hf(model_dir, **eager)
    # an activation is the same code in prefill and decode: logits are enough (and keep the test fast)
    _assert_matches_transformers(model_dir, hf_model, greedy="activation_function" not in overrides)


def test_untied_lm_head_matches_transformers(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=4096, tie_word_embeddings=False, eos_token_id=4095, **SMALL))
    with torch.no_grad():  # an LM head of its own, close enough to wte that greedy text is not one token
        model.lm_head.weight.copy_(model.transformer.wte.weight * 20 + torch.randn_like(model.lm_head.weight))
    model.save_pretrained(tmp_path / "m")
    shutil.copy(Path(DEFAULT_MODEL) / "tokenizer.tiktoken", tmp_path / "m")
    ours = _load(tmp_path / "m")
    assert ours.lm_head is not None and not torch.equal(ours.lm_head.weight, ours.transformer.wte.weight)
    _assert_matches_transformers(tmp_path / "m", model.eval())


EOS_CASES = [  # (config.json's eos_token_id, generation_config.json's: a value, "no key" or "no file")
    (None, "no file"),  # never stops
    (4095, "no key"),  # generation_config.json wins: never stops
    (4095, 7),  # never stops (7 is never generated)
    (7, 4095),  # stops at 4095
    (4095, "no file"),  # stops at 4095
]


@pytest.mark.parametrize(("config_eos", "generation_eos"), EOS_CASES, ids=[f"{c}-{g}" for c, g in EOS_CASES])
def test_eos_token_id_is_the_one_transformers_generate_uses(tmp_path, config_eos, generation_eos):
    from test_01_naive_decode import eos_always_checkpoint

    model_dir = eos_always_checkpoint(tmp_path / "m")  # its argmax is always token 4095
    _edit_json(model_dir / "config.json", eos_token_id=config_eos)
    generation = model_dir / "generation_config.json"
    if generation_eos == "no file":
        generation.unlink()
    else:
        data = json.loads(generation.read_text())
        data.pop("eos_token_id")
        generation.write_text(
            json.dumps(data if generation_eos == "no key" else {**data, "eos_token_id": generation_eos})
        )
    llm = LLM(model_dir, device="cpu")
    hf_model = _hf(model_dir)
    want = hf_greedy(hf_model, [1, 2, 3], 6)
    assert greedy_ids(llm, [1, 2, 3], 6) == want
    stops = generation_eos == 4095 or (config_eos, generation_eos) == (4095, "no file")
    assert want == ([4095] if stops else [4095] * 6)


def _assert_matches_transformers(model_dir: Path, hf_model, greedy: bool = True) -> None:
    """Same logits as transformers on random ids; and greedy text through the engine (paged decode)."""
    ids = torch.randint(0, 4095, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = _load(model_dir)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf_model(ids).logits, rtol=1e-4, atol=1e-4)
    if not greedy:
        return
    llm = LLM(model_dir, device="cpu", dtype="float32")  # prefill + paged decode
    prompt = ids[0, :8].tolist()
    want = hf_greedy(hf_model, prompt, 12)
    assert greedy_ids(llm, prompt, 12) == want
    assert len(set(want)) > 2, "random weights should not repeat one token"


REFUSED = [
    ({"add_cross_attention": True}, "add_cross_attention"),
    ({"activation_function": "prelu"}, "activation_function='prelu'.*learned weights"),
    ({"activation_function": "xielu"}, "activation_function='xielu'"),
    ({"activation_function": "gelu_sparkly"}, "activation_function='gelu_sparkly'"),
    ({"model_type": "gpt_neo"}, "model_type"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    ({"n_head": 3}, "divisible by n_head"),
    ({"n_inner": 0}, "n_inner"),
    ({"n_inner": 100}, "does not match its config.json"),  # the weights are 4 * n_embd wide
    ({"vocab_size": 5000}, "does not match its config.json"),
    ({"layer_norm_epsilon": 0}, "layer_norm_epsilon"),
    ({"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon"),
    ({"scale_attn_weights": "yes"}, "scale_attn_weights"),
    ({"eos_token_id": [4095, -1]}, "eos_token_id"),  # a list of ids is fine (stage 18), a negative id is not
    ({"tie_word_embeddings": False}, "lm_head.weight"),  # untied, but the checkpoint has no head of its own
    ({"n_layer": 3}, "missing"),
]


@pytest.mark.parametrize(("changes", "match"), REFUSED, ids=["=".join(map(str, *c.items()))[:40] for c, _ in REFUSED])
def test_unsupported_config_field_is_refused_at_load(tmp_path, base_checkpoint, changes, match):
    model_dir = tmp_path / "m"
    shutil.copytree(base_checkpoint, model_dir)
    (model_dir / "generation_config.json").unlink()  # so that config.json's eos_token_id counts
    _edit_json(model_dir / "config.json", **changes)
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, device="cpu")


# ---- 2. tokenizer files: a small GPT-2 style BPE, trained here --------------------------------
def train_bpe(flavor: str):
    """'gpt2': <|endoftext|> is the last vocab.json entry, as in GPT-2's own files;
    'specials_first': tokenizers' trainer default (<|endoftext|> is id 0, bytes after it);
    'eot_added': <|endoftext|> only an added token, not in vocab.json;
    'added': 'gpt2' plus added tokens (two special, one not)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    def fresh(model):
        tok = HFTokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        return tok

    tok = fresh(models.BPE())
    first = [EOT] if flavor == "specials_first" else []
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=first,
                                                         initial_alphabet=alphabet, show_progress=False))  # fmt: skip
    if flavor in ("gpt2", "added"):  # rebuild with <|endoftext|> inside the BPE vocabulary, after the merges
        data = json.loads(tok.to_str())["model"]
        vocab = {**data["vocab"], EOT: len(data["vocab"])}
        tok = fresh(models.BPE(vocab, [tuple(m) if isinstance(m, list) else tuple(m.split()) for m in data["merges"]]))
    tok.add_special_tokens([EOT])
    if flavor == "added":
        tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
        tok.add_tokens(["hello world"])
    return tok


def write_tokenizer(tok, out: Path, files: list[str]) -> None:
    from transformers import GPT2TokenizerFast

    full = out.parent / (out.name + "-all")
    GPT2TokenizerFast(tokenizer_object=tok).save_pretrained(full)  # tokenizer.json, tokenizer_config.json
    tok.model.save(str(full))  # vocab.json, merges.txt (transformers 5 no longer writes them)
    for name in files:
        shutil.copy(full / name, out / name)


def make_checkpoint_dir(path: Path, flavor: str, files: list[str], **overrides) -> Path:
    """A random GPT-2 sized for the trained tokenizer, with the chosen tokenizer files only."""
    from transformers import GPT2TokenizerFast

    tok = train_bpe(flavor)
    path.mkdir(parents=True)
    write_tokenizer(tok, path, files)
    hf_tok = GPT2TokenizerFast.from_pretrained(path)
    eot = hf_tok.convert_tokens_to_ids(EOT)
    kw = dict(SMALL, vocab_size=len(hf_tok), eos_token_id=eot, bos_token_id=eot, initializer_range=0.5)
    return make_random_checkpoint(path, seed=1, tokenizer=False, **{**kw, **overrides})


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network: every socket connect fails (and is recorded), Hub offline, an empty tiktoken cache."""
    attempts = []

    def refuse(sock, address, *args):
        attempts.append(address)
        raise OSError(f"network blocked by the test (connect to {address})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-tiktoken-cache"))
    return attempts


# every layout of the files loads with the network blocked, and matches transformers
VM, TJ = ["vocab.json", "merges.txt"], ["tokenizer.json", "tokenizer_config.json"]
LAYOUTS = [
    ("gpt2", VM, "vocab.json + merges.txt"),
    ("gpt2", TJ, "tokenizer.json"),
    ("gpt2", VM + TJ, "vocab.json + merges.txt"),
    ("specials_first", VM, "vocab.json + merges.txt"),
    ("specials_first", TJ, "tokenizer.json"),
    ("eot_added", VM, "vocab.json + merges.txt"),
    ("added", TJ, "tokenizer.json"),
    ("added", VM + TJ, "vocab.json + merges.txt"),
]


@pytest.mark.parametrize(("flavor", "files", "source"), LAYOUTS, ids=[f"{f}:{'+'.join(x)}" for f, x, _ in LAYOUTS])
def test_checkpoint_dir_loads_offline_and_matches_transformers(tmp_path, offline, flavor, files, source):
    from transformers import GPT2TokenizerFast

    model_dir = make_checkpoint_dir(tmp_path / "m", flavor, files)
    hf_model, hf_tok = _hf(model_dir), GPT2TokenizerFast.from_pretrained(model_dir)
    llm = LLM(model_dir, device="cpu", dtype="float32", num_blocks=64, block_size=4)
    tok = llm.tokenizer
    assert tok.source == source
    for text in TRICKY:
        assert tok.encode(text) == hf_tok(text)["input_ids"], text
        assert tok.decode(tok.encode(text)) == text
    prompts = [f"Romeo.\na{EOT}b hello world", " 42 leading"]
    want = [hf_greedy(hf_model, hf_tok(p)["input_ids"], GREEDY.max_tokens) for p in prompts]
    assert len(set(want[0])) > 2, "random weights should not repeat one token"
    assert [greedy_ids(llm, p, GREEDY.max_tokens) for p in prompts] == want  # each request alone
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    eng = llm.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, GREEDY)
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert [done[str(i)] for i in range(len(prompts))] == want
    assert offline == [], "loading must not touch the network"


def test_no_tokenizer_files_is_a_clear_error_without_network(tmp_path, offline):
    for vocab_size in (4096, 50257):  # 50257: GPT-2's vocabulary also tries tiktoken's cache
        model_dir = make_random_checkpoint(tmp_path / str(vocab_size), tokenizer=False, vocab_size=vocab_size, **SMALL)
        with pytest.raises(FileNotFoundError, match="tokenizer.tiktoken, vocab.json \\+ merges.txt, tokenizer.json"):
            LLM(model_dir, device="cpu")
    assert offline == []


def test_gpt2_vocabulary_uses_tiktokens_cached_encoding(tmp_path, offline, monkeypatch):
    """Step 4: a 50257-token GPT-2 with no tokenizer files uses tiktoken's 'gpt2' encoding if it is cached."""
    import hashlib
    import os

    import tiktoken

    cache = Path(os.environ["TIKTOKEN_CACHE_DIR"])
    cache.mkdir()
    for url in GPT2_URLS:  # the files tiktoken's "gpt2" encoding is built from, as tiktoken caches them
        (cache / hashlib.sha1(url.encode()).hexdigest()).write_text("cached")
    stand_in = Tokenizer.from_model_dir(Path(DEFAULT_MODEL)).encoding  # we cannot ship GPT-2's real files
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: stand_in if name == "gpt2" else None)
    tok = Tokenizer.from_model_dir(make_random_checkpoint(tmp_path / "m", tokenizer=False, **SMALL), vocab_size=50257)
    assert tok.source == "tiktoken's cached 'gpt2' encoding" and tok.encoding is stand_in
    assert offline == []


def test_tiktoken_file_comes_first(tmp_path):
    model_dir = make_checkpoint_dir(tmp_path / "m", "gpt2", VM + TJ, vocab_size=4096)
    shutil.copy(Path(DEFAULT_MODEL) / "tokenizer.tiktoken", model_dir)
    assert Tokenizer.from_model_dir(model_dir, 4096).source == "tokenizer.tiktoken"


BAD_TOKENIZERS = [
    ("tokenizer.json", {"model.type": "WordPiece"}, "model.type"),
    (
        "tokenizer.json",
        {
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": EOT}}, {"Sequence": {"id": "A"}}],
                "pair": [],
                "special_tokens": {},
            }
        },
        "cannot load it",  # a malformed post_processor: the tokenizers library's own error, with the file's path
    ),  # fmt: skip
    ("tokenizer_config.json", {"add_bos_token": True}, "add_bos_token"),
    ("tokenizer_config.json", {"add_prefix_space": True}, "add_prefix_space"),
    ("vocab.json", {"Ġthe": 5}, "different vocabularies"),
]


@pytest.mark.parametrize(("name", "changes", "match"), BAD_TOKENIZERS, ids=[m for *_, m in BAD_TOKENIZERS])
def test_tokenizer_that_would_give_other_ids_is_refused(tmp_path, name, changes, match):
    model_dir = make_checkpoint_dir(tmp_path / "m", "gpt2", VM + TJ)
    _edit_json(model_dir / name, **changes)
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, device="cpu")


@pytest.mark.parametrize("changes", [{"normalizer": {"type": "NFC"}}, {"pre_tokenizer.add_prefix_space": True}])
def test_a_tokenizer_json_tiktoken_cannot_run_goes_through_the_tokenizers_library(tmp_path, changes):
    """Since stage 18 a tokenizer.json that is not GPT-2's plain pipeline is read by the `tokenizers` library
    (roseinfer/tokenizer/fast_tokenizer.py) instead of being refused, and runs as the file says. (transformers 5's
    GPT2TokenizerFast rebuilds GPT-2's pipeline from its own code and so would ignore these two edits.)"""
    from tokenizers import Tokenizer as HFTokenizer

    from roseinfer.tokenizer import FastTokenizer

    model_dir = make_checkpoint_dir(tmp_path / "m", "gpt2", TJ)
    _edit_json(model_dir / "tokenizer.json", **changes)
    with LLM(model_dir, device="cpu") as llm:
        assert isinstance(llm.tokenizer, FastTokenizer)
        text = "Café, naïve: the  e\u0301 test"
        assert llm.tokenizer.encode(text) == HFTokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids


def test_vocab_ids_out_of_merge_order_are_refused(tmp_path):
    model_dir = make_checkpoint_dir(tmp_path / "m", "specials_first", VM)
    vocab = json.loads((model_dir / "vocab.json").read_text())
    a, b = sorted(vocab, key=vocab.get)[-2:]  # the last two merges swap ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (model_dir / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match="merge order"):
        LLM(model_dir, device="cpu")


def test_malformed_merges_txt_is_refused(tmp_path):
    model_dir = make_checkpoint_dir(tmp_path / "m", "gpt2", VM)
    with (model_dir / "merges.txt").open("a", encoding="utf-8") as f:
        f.write("Ġ t h\n")
    with pytest.raises(ValueError, match="two tokens"):
        LLM(model_dir, device="cpu")


def test_bundled_model_loads_in_transformers_tokenizer_with_same_ids(llm, tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    copy = tmp_path / "no-tiktoken"  # the same directory read through vocab.json + merges.txt
    shutil.copytree(DEFAULT_MODEL, copy, ignore=shutil.ignore_patterns("tokenizer.tiktoken", "*.safetensors"))
    model_config = llm.llm_engine.config.model_config
    from_files = Tokenizer.from_model_dir(copy, model_config.vocab_size)
    assert llm.tokenizer.source == "tokenizer.tiktoken" and from_files.source == "vocab.json + merges.txt"
    for text in TRICKY + PROMPTS:
        assert llm.tokenizer.encode(text) == from_files.encode(text) == hf(text)["input_ids"], text
    assert hf.eos_token_id == model_config.eos_token_id


# ---- 3. Hub ids, from a local stand-in for the Hub cache ----------------------------------------
HUB_SCRIPT = """
import json, socket, sys
def refuse(*a):
    raise OSError("network blocked by the test")
socket.socket.connect = refuse
from roseinfer import LLM, SamplingParams
out = {}
for repo in sys.argv[1:]:
    llm = LLM(repo, device="cpu", dtype="float32", num_blocks=64)
    res = llm.generate(["Romeo.\\n", "hello world"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    model_dir = llm.llm_engine.config.model_config.model_dir
    out[repo] = {"dir": str(model_dir), "ids": [r.token_ids for r in res], "source": llm.tokenizer.source}
print(json.dumps(out))
"""


def test_hub_ids_resolve_from_the_hub_cache_offline(tmp_path):
    """`LLM("gpt2")` etc. with HF_HUB_OFFLINE=1 and a cache laid out as huggingface_hub writes it."""
    from transformers import GPT2TokenizerFast

    hub, sha = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    weights = {"gpt2": "model.safetensors", "distilgpt2": "pytorch_model.bin", "gpt2-medium": "model.safetensors"}
    for repo, fmt in weights.items():
        snap = hub / f"models--{repo}" / "snapshots" / sha
        make_checkpoint_dir(snap, "gpt2", VM + TJ, safetensors=fmt == "model.safetensors")
        _edit_json(snap / "config.json", n_ctx=64, task_specific_params={"text-generation": {"do_sample": True}})
        (hub / f"models--{repo}" / "refs").mkdir()
        (hub / f"models--{repo}" / "refs" / "main").write_text(sha)
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(hub), "TIKTOKEN_CACHE_DIR": str(tmp_path / "tk")}
    r = run_python("-c", HUB_SCRIPT, *weights, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for repo in weights:
        snap = hub / f"models--{repo}" / "snapshots" / sha
        assert Path(got[repo]["dir"]) == snap and got[repo]["source"] == "vocab.json + merges.txt"
        hf_model, hf_tok = _hf(snap), GPT2TokenizerFast.from_pretrained(snap)
        assert got[repo]["ids"] == [hf_greedy(hf_model, hf_tok(p)["input_ids"], 8) for p in ("Romeo.\n", "hello world")]


def test_hub_download_asks_for_tokenizer_files_and_one_weights_file(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []
    snap = make_random_checkpoint(tmp_path / "snap", safetensors=False, **SMALL)  # a repo with pytorch_model.bin only

    def fake_snapshot_download(repo_id, allow_patterns):
        calls.append(list(allow_patterns))
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    model_dir = resolve_model_dir("gpt2")
    assert {"config.json", "vocab.json", "merges.txt", "tokenizer.json", "model*.safetensors*"} <= set(calls[0])
    assert "pytorch_model.bin" not in calls[0] and calls[1:] == [["pytorch_model.bin"]]
    assert model_dir == snap and _load(model_dir).config.n_embd == SMALL["n_embd"]  # the downloaded weights load
