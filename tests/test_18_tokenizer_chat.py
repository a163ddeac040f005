"""Tokenizers beyond GPT-2 (tokenizer.json through the `tokenizers` library) and chat templates.

Small tokenizer directories are trained here in milliseconds, in the shapes real checkpoints have, and saved by
transformers itself; every answer is compared with transformers' AutoTokenizer on the same directory:

    llama3      byte-level BPE, Llama 3's split regex, a post-processor that adds <|begin_of_text|>, header tokens
    qwen2       byte-level BPE, NFC, Qwen2's regex, no BOS, ChatML <|im_start|>/<|im_end|>, a non-special <think>
                (tokenizer_class Qwen2Tokenizer, and vocab.json + merges.txt beside tokenizer.json, as on the Hub)
    sp_legacy   SentencePiece BPE with byte fallback, Llama 2's normalizer (Prepend "▁"), <s> added, [INST] template
    sp_meta     the same vocabulary with a Metaspace pre-tokenizer (tokenizer_class LlamaTokenizer, as Mistral)
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from roseinfer import DEFAULT_MODEL, SamplingParams  # noqa: E402
from roseinfer.engine.detokenizer import Detokenizer  # noqa: E402
from roseinfer.entrypoints import chat_utils  # noqa: E402
from roseinfer.tokenizer import FastTokenizer, Tokenizer  # noqa: E402

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_PAT = _CONTRACTIONS + r"\p{N}{1,3}" + _REST  # numbers in runs of up to 3 digits
QWEN2_PAT = _CONTRACTIONS + r"\p{N}" + _REST  # one digit at a time
CORPUS = ["Hello world! The quick brown fox jumps over the lazy dog. Hello there, how are you?",
          "def main():\n    print('hi')\n    return 0\n\n", "naïve café résumé, 東京 and 日本語 text",
          "  two spaces, 3.14159 and 2024 numbers", "<b>bold</b> and [brackets] {braces}"] * 30  # fmt: skip
# the published templates (Meta-Llama-3-8B-Instruct, Qwen2-7B-Instruct, Mistral-7B-Instruct-v0.1)
LLAMA3_TEMPLATE = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                   "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
                   "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                   "{{ content }}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")  # fmt: skip
QWEN2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                  "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
                  "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")  # fmt: skip
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
                    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
                    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
                    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
                    "{{ message['content'] + eos_token + ' ' }}{% else %}{{ raise_exception('Only user and "
                    "assistant roles are supported!') }}{% endif %}{% endfor %}")  # fmt: skip
NAMES = ["llama3", "qwen2", "sp_legacy", "sp_meta"]
TEXTS = ["Hello world!", " leading space", "  two", "x", "tabs\tand  spaces  ", "1234567 numbers", "café naïve",
         "emoji 🌹🎉 and 東京 日本語\n\nnew", "\n\nline\r\nwin", "Hi <|eot_id|> there <s> x </s>",
         "<|begin_of_text|><|start_header_id|>user<|end_header_id|>", "<|im_start|>user\nhi<think>x</think><|im_end|>",
         "[INST] what? [/INST]", "e\u0301 (NFD) vs é", "ü" * 5 + "ß€𝄞"]  # fmt: skip


def conversation(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in turns]


CHATS = [
    conversation(("user", "Hello there! 🌹")),
    conversation(("user", "Hi"), ("assistant", "Hello."), ("user", "  What is 東京?\n")),
    conversation(("system", "Be brief."), ("user", "<|eot_id|> and <s> typed")),
]


# ---- building the directories --------------------------------------------------------------------------------
def _byte_level(pat: str, vocab_size: int) -> HFTokenizer:
    tok = HFTokenizer(models.BPE(ignore_merges=True))
    split, to_bytes = pre_tokenizers.Split(Regex(pat), "isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, to_bytes])
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet,
                                                        show_progress=False))  # fmt: skip
    return tok


def _sentencepiece(legacy_normalizer: bool) -> HFTokenizer:
    """Llama 2's layout: <unk> <s> </s>, then the 256 byte tokens <0x00>..<0xFF>, then the BPE pieces."""
    t = HFTokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, limit_alphabet=60, show_progress=False))
    trained = json.loads(t.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for token, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) for m in trained["merges"]]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if legacy_normalizer:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # fmt: skip
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                       special_tokens=[("<s>", 1)])  # fmt: skip
    return tok


def _save(tok: HFTokenizer, path: Path, tokenizer_class: str, template_in_config: bool, **config) -> Path:
    """Saved by transformers 5 (tokenizer.json, tokenizer_config.json, chat_template.jinja); a None in `config` is
    written as null (as Qwen2's "bos_token": null, which overrides the class's default)."""
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                         **config).save_pretrained(path)  # fmt: skip
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = tokenizer_class
    cfg.update({k: v for k, v in config.items() if v is None})
    if template_in_config:  # transformers 4's place for it
        cfg["chat_template"] = (path / "chat_template.jinja").read_text()
        (path / "chat_template.jinja").unlink()
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return path


def build(name: str, path: Path) -> Path:
    if name == "llama3":
        tok = _byte_level(LLAMA3_PAT, 500)
        tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                "<|eot_id|>"])  # fmt: skip
        bos = tok.token_to_id("<|begin_of_text|>")
        bot = "<|begin_of_text|>"
        add_bos = processors.TemplateProcessing(single=f"{bot} $A", pair=f"{bot} $A {bot} $B:1",
                                                special_tokens=[(bot, bos)])  # fmt: skip
        tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), add_bos])
        return _save(tok, path, "PreTrainedTokenizerFast", True, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                     chat_template=LLAMA3_TEMPLATE)  # fmt: skip
    if name == "qwen2":
        tok = _byte_level(QWEN2_PAT, 450)
        tok.normalizer = normalizers.NFC()
        tok.post_processor = processors.ByteLevel(trim_offsets=False, add_prefix_space=False, use_regex=False)
        tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
        path = _save(tok, path, "Qwen2Tokenizer", False, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                     bos_token=None, unk_token=None, chat_template=QWEN2_TEMPLATE)  # fmt: skip
        model = json.loads((path / "tokenizer.json").read_text())["model"]
        (path / "vocab.json").write_text(json.dumps(model["vocab"]))
        (path / "merges.txt").write_text("#version: 0.2\n" + "".join(" ".join(m) + "\n" for m in model["merges"]))
        return path
    legacy = name == "sp_legacy"
    extra = {} if legacy else {"legacy": False}
    names = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    cls = "PreTrainedTokenizerFast" if legacy else "LlamaTokenizer"
    return _save(_sentencepiece(legacy), path, cls, legacy, chat_template=MISTRAL_TEMPLATE, **names, **extra)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: build(name, root / name) for name in NAMES}


@pytest.fixture(scope="module")
def pair(dirs):
    """name -> (our tokenizer, transformers' AutoTokenizer), loaded once."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = Tokenizer.from_model_dir(dirs[name]), transformers.AutoTokenizer.from_pretrained(dirs[name])
        return cache[name]

    return get


def stream(tok, ids: list[int]) -> str:
    detok = Detokenizer(tok.token_bytes_table, (), (tok.eos_token_id,))
    return "".join(detok.step(i) for i in ids) + detok.flush()


# ---- the tokenizer -----------------------------------------------------------------------------------------
def test_from_model_dir_picks_the_tokenizer(dirs, tmp_path):
    for name in NAMES:  # tiktoken refuses these tokenizer.json files: the tokenizers library runs them
        assert isinstance(Tokenizer.from_model_dir(dirs[name]), FastTokenizer), name
    assert type(Tokenizer.from_model_dir(Path(DEFAULT_MODEL))) is Tokenizer  # tokenizer.tiktoken: unchanged
    # GPT-2's plain tokenizer.json stays on tiktoken
    model = Path(DEFAULT_MODEL)
    tok = HFTokenizer(models.BPE.from_file(str(model / "vocab.json"), str(model / "merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    gpt2 = Tokenizer.from_model_dir(tmp_path)
    assert type(gpt2) is Tokenizer and gpt2.source == "tokenizer.json"
    assert gpt2.encode("Romeo, Romeo!") == tok.encode("Romeo, Romeo!").ids


@pytest.mark.parametrize("name", NAMES)
def test_encode_matches_transformers(pair, name):
    tok, hf = pair(name)
    for text in TEXTS:
        assert tok.encode(text) == hf(text)["input_ids"], text
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"], text
    assert tok.vocab_size == len(hf)
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert tok.special_tokens_map == hf.special_tokens_map
    assert set(tok.special_ids) == {i for i, t in hf.added_tokens_decoder.items() if t.special}  # skipped in text


@pytest.mark.parametrize("name", NAMES)
def test_decode_matches_transformers_and_the_stream(pair, name):
    tok, hf = pair(name)
    specials = set(tok.special_ids)
    sentencepiece = name.startswith("sp")
    rng = random.Random(0)
    plain = [i for i in range(tok.vocab_size) if i not in specials and not (sentencepiece and 3 <= i < 259)]
    sequences = [hf(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    sequences += [rng.sample(plain, 12) + [tok.eos_token_id] for _ in range(30)]  # "generated", EOS at the end
    prompt = hf("Prompt:")["input_ids"]
    for ids in sequences:
        text = tok.decode(ids)
        assert stream(tok, ids) == text  # the streaming detokenizer builds the same text
        theirs = hf.decode(ids, skip_special_tokens=True)
        if sentencepiece:  # the text continues a prompt: the first "▁" keeps its space (module docstring)
            assert (text[1:] if text.startswith(" ") else text) == theirs
            before = hf.decode(prompt, skip_special_tokens=True)
            assert hf.decode(prompt + ids, skip_special_tokens=True) == before + text
        else:  # byte-level: exactly transformers' text, incomplete UTF-8 (random ids) included
            assert text == theirs


def test_token_bytes(pair):
    llama3, _ = pair("llama3")
    qwen2, _ = pair("qwen2")
    sp, _ = pair("sp_legacy")
    vocab = llama3._tokenizer.get_vocab()
    assert llama3.token_bytes(vocab["Ġ"]) == b" " and llama3.token_bytes(vocab["Ċ"]) == b"\n"
    assert llama3.token_bytes(vocab["ð"]) == b"\xf0"  # one byte of a 4-byte emoji
    for t in ("<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>"):  # control tokens make no text
        assert llama3.token_bytes(vocab[t]) == b""
    assert qwen2.token_bytes(qwen2._tokenizer.token_to_id("<think>")) == b"<think>"  # added, not special
    assert qwen2.token_bytes(qwen2.eos_token_id) == b""
    spv = sp._tokenizer.get_vocab()
    assert sp.token_bytes(spv["▁"]) == b" " and sp.token_bytes(spv["<0x0A>"]) == b"\n"
    assert sp.token_bytes(spv["<0xF0>"]) == b"\xf0" and sp.token_bytes(1) == b"" and sp.token_bytes(0) == b""
    word = next(t for t in spv if t.startswith("▁") and len(t) > 3)
    assert sp.token_bytes(spv[word]) == word.replace("▁", " ").encode()
    assert len(sp.token_bytes_table) == sp.vocab_size
    with pytest.raises(KeyError):
        sp.token_bytes(sp.vocab_size)


# ---- chat templates ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_chat_template_matches_transformers(pair, name):
    tok, hf = pair(name)
    for messages in CHATS if name in ("llama3", "qwen2") else CHATS[:2]:  # Mistral's template has no system role
        for gen in (True, False):
            text, ids = chat_utils.chat_prompt_token_ids(tok, messages, add_generation_prompt=gen)
            assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            hf_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            assert ids == list(getattr(hf_ids, "input_ids", hf_ids))
            if tok.bos_token_id is not None:  # the template writes the BOS; tokenizing adds no second one
                assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
            template = chat_utils.resolve_chat_template(tok.chat_template)
            assert chat_utils.render_with_jinja2(template, messages, gen, **tok.special_tokens_map) == text


def test_chat_template_sources(dirs, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(dirs["qwen2"], d)  # template in chat_template.jinja
    msgs = [{"role": "user", "content": "hi"}]
    assert Tokenizer.from_model_dir(d).chat_template == QWEN2_TEMPLATE
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "config: {{ messages[0]['content'] }}"  # the .jinja file wins over the config
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_model_dir(d).chat_template == QWEN2_TEMPLATE
    (d / "chat_template.jinja").unlink()
    tok = Tokenizer.from_model_dir(d)
    assert chat_utils.apply_chat_template(tok, msgs) == "config: hi"
    assert chat_utils.apply_chat_template(tok, msgs, chat_template="given: {{ messages[0]['content'] }}") == "given: hi"
    (d / "additional_chat_templates").mkdir()
    (d / "chat_template.jinja").write_text("default: {{ messages[0]['content'] }}")
    (d / "additional_chat_templates" / "tool_use.jinja").write_text("tools: {{ messages[0]['content'] }}")
    tok = Tokenizer.from_model_dir(d)
    assert chat_utils.apply_chat_template(tok, msgs) == "default: hi"
    assert chat_utils.apply_chat_template(tok, msgs, chat_template="tool_use") == "tools: hi"
    cfg["chat_template"] = [{"name": "default", "template": "list: {{ messages[0]['content'] }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    shutil.rmtree(d / "additional_chat_templates")
    (d / "chat_template.jinja").unlink()
    assert chat_utils.apply_chat_template(Tokenizer.from_model_dir(d), msgs) == "list: hi"


# ---- errors ------------------------------------------------------------------------------------------------
def test_tokenizer_errors(dirs, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no tokenizer found for model .*empty.*tokenizer\.json"):
        Tokenizer.from_model_dir(tmp_path / "empty")
    for decoder, what in ((decoders.WordPiece(), "WordPiece"), (None, "has no decoder"),
                          (decoders.Sequence([decoders.Fuse(), decoders.Strip(" ", 0, 1)]), "stop > 0")):  # fmt: skip
        d = tmp_path / what.replace(" ", "_")
        shutil.copytree(dirs["sp_legacy"], d)
        j = json.loads((d / "tokenizer.json").read_text())
        j["decoder"] = None if decoder is None else json.loads(decoder.__getstate__())
        (d / "tokenizer.json").write_text(json.dumps(j))
        with pytest.raises(ValueError, match=rf"tokenizer\.json.*{what}"):
            Tokenizer.from_model_dir(d)
    j = json.loads((dirs["sp_legacy"] / "tokenizer.json").read_text())
    j["model"]["type"] = "WordPiece"
    shutil.copytree(dirs["sp_legacy"], tmp_path / "wp")
    (tmp_path / "wp" / "tokenizer.json").write_text(json.dumps(j))
    with pytest.raises(ValueError, match=r"tokenizer\.json: model\.type='WordPiece' is not supported"):
        Tokenizer.from_model_dir(tmp_path / "wp")


def test_chat_errors(pair):
    tok, _ = pair("sp_meta")
    gpt2 = Tokenizer.from_model_dir(Path(DEFAULT_MODEL))
    with pytest.raises(ValueError, match="no chat template"):
        chat_utils.apply_chat_template(gpt2, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="roles must alternate"):  # the template's raise_exception
        chat_utils.apply_chat_template(tok, [{"role": "assistant", "content": "hi"}])
    bad = [("hi", TypeError, "must be a list"), ([], ValueError, "empty"),
           (["hi"], TypeError, "message 0 must be a dict"),
           ([{"role": "user"}], ValueError, "message 0 has no 'content'"),
           ([{"content": "x"}], ValueError, "has no 'role'"),
           ([{"role": "user", "content": [{"type": "text"}]}], TypeError, "content must be a string"),
           ([[{"role": "user", "content": "a"}], [{"role": "user"}]], ValueError, "conversation 1, message 0"),
           ([[{"role": "user", "content": "a"}], "b"], TypeError, "conversation 1 must be a list")]  # fmt: skip
    for messages, error, match in bad:
        with pytest.raises(error, match=match):
            chat_utils.parse_chat_messages(messages)


# ---- LLM.chat end to end (the bundled GPT-2 with a template added) -----------------------------------------
def test_llm_chat(tmp_path):
    from roseinfer import LLM

    d = tmp_path / "gpt2-chat"
    shutil.copytree(DEFAULT_MODEL, d)
    template = ("{% for m in messages %}{{ m['role'] | upper }}.\n{{ m['content'] }}\n\n{% endfor %}"
                "{% if add_generation_prompt %}{{ 'ROMEO.\n' }}{% endif %}")  # fmt: skip
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    llm = LLM(str(d), device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=12)
    conv = [{"role": "juliet", "content": "Wherefore art thou Romeo?"}]
    conv2 = [{"role": "king", "content": "Speak."}, {"role": "hamlet", "content": "Words, words."}]
    outs = llm.chat([conv, conv2], params, use_tqdm=False)
    for out, messages in zip(outs, [conv, conv2], strict=True):
        text = chat_utils.apply_chat_template(llm.tokenizer, messages)
        assert out.prompt == text and text.endswith("ROMEO.\n")
        ref = llm.generate([llm.tokenizer.encode(text)], params, use_tqdm=False)[0]
        assert out.prompt_token_ids == ref.prompt_token_ids
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.outputs[0].text == ref.outputs[0].text
    assert llm.chat(conv, params, use_tqdm=False)[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    no_prompt = llm.chat(conv, params, use_tqdm=False, add_generation_prompt=False)[0]
    assert not no_prompt.prompt.endswith("ROMEO.\n")
    with pytest.raises(TypeError, match="content must be a string"):
        llm.chat([{"role": "user", "content": None}], params)

    plain = LLM(DEFAULT_MODEL, device="cpu", dtype="float32")  # no template: an error that says what to do
    with pytest.raises(ValueError, match="no chat template.*chat_template="):
        plain.chat(conv, params, use_tqdm=False)
    given = plain.chat(conv, params, use_tqdm=False, chat_template=template)[0]
    assert given.outputs[0].token_ids == outs[0].outputs[0].token_ids
