"""Stage 18: a Llama-architecture model through the engine, and what grouped-query attention does to KV memory.

    python examples/llama_example.py                  # the bundled tiny Llama (GQA: 8 query heads, 2 K/V heads)
    python examples/llama_example.py --model DIR      # any Llama / Mistral / Qwen2 / Qwen3 directory

1. The model's shape as the engine reads it from config.json (registry.py picks the class).
2. KV bytes per token and how many full-context sequences fit in the same KV memory: the bundled GPT-2 vs the
   bundled Llama, and GPT-2 small vs SmolLM2-135M (shapes only, no weights needed).
3. Greedy text from the engine, checked token by token against transformers' `generate` on the same weights.
4. A chat turn: the model's chat template rendered as transformers renders it, then generated.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from roseinfer import DEFAULT_MODEL, LLM, SamplingParams  # noqa: E402
from roseinfer.model_executor.gpt2 import GPT2Config  # noqa: E402
from roseinfer.model_executor.llama_config import LlamaConfig  # noqa: E402

LLAMA_MODEL = REPO / "roseinfer" / "models" / "tiny-llama-shakespeare"
KV_MEMORY = 64 * 2**20  # the KV pool for the two bundled models
SHAPES_KV_MEMORY = 4 * 2**30  # ... and for released shapes (the KV pool every engine gets in scripts/benchmark.py)
SMOLLM2 = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
)
SHAPES = {  # config.json fields of released models (shapes only), and SmolLM2 as if it had a K/V head per query head
    "GPT-2 small": GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=1024),
    "SmolLM2-135M": LlamaConfig.from_hf(SMOLLM2),
    "SmolLM2-135M as MHA": LlamaConfig.from_hf({**SMOLLM2, "num_key_value_heads": 9}),
}


def kv_row(name: str, cfg, memory: int, context: int) -> str:
    """One table row: K and V of every layer, fp32, per token; tokens and sequences of `context` tokens in `memory`."""
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    heads = f"{cfg.num_attention_heads} q / {cfg.num_key_value_heads} kv"
    return (
        f"{name:<22} {cfg.num_hidden_layers:>6} {heads:>13} {cfg.head_dim:>8} {per_token:>12,} "
        f"{memory // 2**20:>7,} MiB {memory // per_token:>10,} {memory // (per_token * context):>5,} x {context}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(LLAMA_MODEL))
    ap.add_argument("--prompt", default="ROMEO.\n")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.manual_seed(0)

    llm = LLM(args.model, device="cpu", dtype="float32", kv_cache_memory=KV_MEMORY)
    mc = llm.llm_engine.config.model_config
    cfg = mc.hf_config
    print(f"== 1. {Path(args.model).name}: {cfg.architecture if hasattr(cfg, 'architecture') else 'GPT-2'}")
    print(f"layers {cfg.num_hidden_layers}, hidden {cfg.hidden_size}, {cfg.num_attention_heads} query heads over "
          f"{cfg.num_key_value_heads} K/V heads (head_dim {cfg.head_dim}), context {mc.max_model_len}, "
          f"EOS ids {list(mc.eos_token_ids)}")  # fmt: skip

    print("\n== 2. KV cache per token (fp32, K and V, every layer), and how many tokens and sequences a pool holds")
    print(f"{'model':<22} {'layers':>6} {'heads':>13} {'head_dim':>8} {'bytes/token':>12} {'KV pool':>11} "
          f"{'tokens':>10} {'sequences':>12}")  # fmt: skip
    gpt2 = LLM(DEFAULT_MODEL, device="cpu", dtype="float32").llm_engine.config.model_config.hf_config
    print(kv_row("bundled GPT-2", gpt2, KV_MEMORY, gpt2.max_position_embeddings))
    print(kv_row(f"{Path(args.model).name}", cfg, KV_MEMORY, mc.max_model_len))
    for name, shape in SHAPES.items():
        print(kv_row(name, shape, SHAPES_KV_MEMORY, 1024))
    cache = llm.llm_engine.config.cache_config
    print(f"(the engine sized {Path(args.model).name}'s {KV_MEMORY // 2**20} MiB pool at {cache.num_gpu_blocks} "
          f"blocks of {cache.block_size} tokens)")  # fmt: skip

    print(f"\n== 3. greedy, {args.max_tokens} tokens, against transformers")
    out = llm.generate([args.prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0), use_tqdm=False)[0]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens, do_sample=False)
    ref = ref[0, ids.shape[1] :].tolist()
    print(f"prompt ids {out.prompt_token_ids}")
    print(repr(args.prompt + out.outputs[0].text))
    print(f"token ids identical to transformers: {out.outputs[0].token_ids == ref} "
          f"({len(out.outputs[0].token_ids)} tokens, finish_reason={out.outputs[0].finish_reason})")  # fmt: skip

    print("\n== 4. a chat turn through the model's chat template")
    messages = [{"role": "user", "content": "What say you of the king?"}]
    chat = llm.chat(messages, SamplingParams(max_tokens=args.max_tokens, temperature=0), use_tqdm=False)[0]
    print(f"rendered prompt: {chat.prompt!r}")
    print(f"reply: {chat.outputs[0].text!r} (finish_reason={chat.outputs[0].finish_reason})")


if __name__ == "__main__":
    main()
