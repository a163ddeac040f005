"""Shared fixtures: the bundled model, its HF twin, and small random checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # run stage 08's Triton kernels in Triton's CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (read when the kernels are defined: before any import)

from roseinfer import DEFAULT_MODEL  # noqa: E402
from tools.models.checkpoints import make_random_checkpoint  # noqa: E402, F401  (the tests import it from here)

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    """Tests marked @pytest.mark.cuda need a GPU: skip them without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def core(engine):
    """The in-process EngineCore behind an LLMEngine (or an LLM's, or an AsyncLLMEngine's): the tests look at
    its scheduler, KV cache manager and model runner; the engine itself only talks to it through its client."""
    engine = getattr(engine, "llm_engine", engine)
    engine = getattr(engine, "engine", engine)  # AsyncLLMEngine -> LLMEngine
    return engine.engine_core.engine_core


def run_python(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python ARGS...` from the repo root with this checkout's roseinfer importable."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=env)


PROMPTS = [
    "Romeo.\n",
    "First Citizen.\nBefore we proceed any further, hear me speak.\n",
    "KING.",
    "O, what a rogue and peasant slave am I!",
    "Enter Hamlet, reading.\n\nPolonius.\nWhat do you read, my lord?\n\nHamlet.\nWords, words, words.\n",
    "To be, or not to be",
    "\n",
    "The quality of mercy is not strain'd;\nIt droppeth as the gentle rain from heaven\n",
]


@pytest.fixture(scope="session")
def llm():
    """The bundled model behind the offline API, fp32 on the CPU (shared: tests must leave it idle)."""
    from roseinfer import LLM

    return LLM(DEFAULT_MODEL, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tokenizer(llm):
    return llm.tokenizer


def greedy_ids(llm, prompt, max_tokens: int, **params) -> list[int]:
    """One request alone through `llm`: its token ids, greedy (an EOS, if produced, is the last one)."""
    from roseinfer import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, **params)
    return llm.generate([prompt], sp, use_tqdm=False)[0].token_ids


@pytest.fixture
def make_engine():
    """LLMEngine factory (bundled model, fp32 CPU); every engine must end its test with all KV blocks free."""
    from roseinfer import LLMEngine

    made = []

    def make(**kw):
        eng = LLMEngine(device="cpu", dtype="float32", **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        assert core(eng).kv_cache_manager.stats().used_blocks == 0, "KV blocks leaked"


def run_all(eng) -> dict[str, list[int]]:
    """Step an LLMEngine until every request finished: each request's token ids."""
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


@pytest.fixture(scope="session")
def hf_model():
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face `generate`, greedy, fp32: the reference every stage must match."""
    x = torch.tensor([prompt_ids])
    eos = hf_model.config.eos_token_id
    out = hf_model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=eos
    )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> Path:
    return make_random_checkpoint(tmp_path_factory.mktemp("random-gpt2"))


LLAMA_FAMILY = {  # config.json's architecture -> transformers' (config class, model class) names
    "LlamaForCausalLM": ("LlamaConfig", "LlamaForCausalLM"),
    "MistralForCausalLM": ("MistralConfig", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("Qwen2Config", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def make_llama_checkpoint(path: Path, arch: str = "LlamaForCausalLM", seed: int = 0, weight_scale: float = 4.0,
                          save_dtype: torch.dtype = torch.float32, max_shard_size: str | None = None,
                          tokenizer: bool = True, **overrides):  # fmt: skip
    """Save a small random model of a Llama-family `arch` in HF format to `path` and return the transformers
    model (fp32). The matrices are scaled by `weight_scale` so that logits are peaky (greedy ties are rare).
    `save_dtype` bf16/fp16: the checkpoint's weights in that dtype (the returned model holds the same rounded
    values in fp32). `max_shard_size`: a sharded checkpoint with model.safetensors.index.json. `tokenizer`: a
    placeholder tokenizer.tiktoken (the 256 bytes, then distinct strings; id vocab_size - 1 is <|endoftext|>)."""
    import base64

    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in LLAMA_FAMILY[arch])
    kw = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=383)  # fmt: skip
    if arch == "MistralForCausalLM":
        kw["sliding_window"] = None
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(weight_scale)
            p.copy_(p.to(save_dtype).float())  # the values the checkpoint will hold
    path.mkdir(parents=True, exist_ok=True)
    model.to(save_dtype).save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    model.float()
    if tokenizer:
        vocab = kw["vocab_size"]
        toks = [bytes([b]) for b in range(256)] + [b"<%d>" % i for i in range(256, vocab - 1)]
        lines = [f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(toks)]
        (path / "tokenizer.tiktoken").write_text("".join(lines))
    return model
