"""Stage 22: the bundled tiny Llama quantized, run, and compared with itself in fp32.

    python examples/quantization_example.py

1. The quantize script writes int8 copies of the checkpoint (compressed-tensors, the format vLLM runs):
   what one layer's tensors become, and what the decoder's linear weights weigh.
2. The same prompts, greedy, in fp32, with int8 weights and activations (W8A8), with int8 weights only
   (W8A16), and with an fp8 KV cache: each output's tokens equal to fp32's from the start.
3. What an fp8 KV cache buys: the blocks the engine counts in the same memory, fp32 against fp8.
4. A checkpoint it cannot run: the error names the field.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from safetensors import safe_open

from roseinfer import LLM, SamplingParams
from tools.models.quantize_w8a8 import quantize_checkpoint

MODEL = Path("roseinfer/models/tiny-llama-shakespeare")
PROMPTS = ["ROMEO:\nBut soft, what light", "To be, or not to be", "KING HENRY:\nOnce more unto the breach"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
LAYER = "model.layers.0.mlp.down_proj"


def linear_bytes(model_dir: Path) -> int:
    """Bytes of the decoder's linear weights (and their scales) as the checkpoint stores them."""
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return sum(f.get_tensor(k).nbytes for k in f.keys() if ".layers." in k and "proj" in k)  # noqa: SIM118


def same_start(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="roseinfer-22-"))
    dirs = {"W8A8": work / "w8a8", "W8A16": work / "w8a16"}
    for scheme, out in dirs.items():
        n = quantize_checkpoint(MODEL, out, scheme=scheme)
        print(f"$ python scripts/quantize_w8a8.py {MODEL} <dir> --scheme {scheme}   ({n} linear layers)")
    qc = json.loads((dirs["W8A8"] / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    print(f"\n1. quantization_config: {qc['quant_method']}, format {qc['format']}, weights "
          f"{group['weights']['strategy']}, activations {group['input_activations']['strategy']} "
          f"(dynamic={group['input_activations']['dynamic']}), ignore {qc['ignore']}")  # fmt: skip
    with safe_open(dirs["W8A8"] / "model.safetensors", "pt") as f:
        for k in (f"{LAYER}.weight", f"{LAYER}.weight_scale"):
            t = f.get_tensor(k)
            print(f"   {k:<42} {str(t.dtype):<14} {list(t.shape)}")
    fp32, w8a8 = linear_bytes(MODEL), linear_bytes(dirs["W8A8"])
    print(f"   decoder linear weights: fp32 {fp32 / 2**20:.2f} MiB -> int8 + scales {w8a8 / 2**20:.2f} MiB")

    print("\n2. greedy, 32 tokens; tokens equal to fp32's from the start, per prompt")
    runs = {"fp32": LLM(str(MODEL)), "W8A8": LLM(str(dirs["W8A8"])), "W8A16": LLM(str(dirs["W8A16"])),
            "fp8 KV cache": LLM(str(MODEL), kv_cache_dtype="fp8")}  # fmt: skip
    outs = {name: llm.generate(PROMPTS, GREEDY, use_tqdm=False) for name, llm in runs.items()}
    base = [o.outputs[0].token_ids for o in outs["fp32"]]
    for name, res in outs.items():
        ids = [o.outputs[0].token_ids for o in res]
        print(f"   {name:<13} {[same_start(a, b) for a, b in zip(ids, base, strict=True)]}  "
              f"{res[0].outputs[0].text[:48]!r}")  # fmt: skip

    print("\n3. blocks of 16 tokens in a 16 MiB KV pool (counted by the engine)")
    for kv in ("auto", "fp8"):
        llm = LLM(str(MODEL), kv_cache_dtype=kv, kv_cache_memory=16 * 2**20)
        cfg = llm.llm_engine.config
        print(
            f"   kv_cache_dtype={kv!r:<7} {cfg.model_config.kv_cache_dtype}: "
            f"{cfg.model_config.kv_bytes_per_token()} bytes per token, {cfg.cache_config.num_gpu_blocks} blocks"
        )

    print("\n4. a checkpoint roseinfer cannot run")
    bad = work / "awq"
    bad.mkdir()
    hf = json.loads((MODEL / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (bad / "config.json").write_text(json.dumps(hf))
    try:
        LLM(str(bad))
    except ValueError as e:
        print(f"   ValueError: {e}")


if __name__ == "__main__":
    main()
