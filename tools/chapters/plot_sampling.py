"""Chapter 02's picture: one next-token distribution, before and after filtering.

python tools/chapters/plot_sampling.py --out chapters/02-kv-cache/sampling.png
"""

from __future__ import annotations

import argparse

import torch

from roseinfer import DEFAULT_MODEL
from roseinfer.model_executor.loader import load_model, read_model_config, resolve_model_dir
from roseinfer.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt", default="Romeo.\nBut soft! what light through yonder window")
    ap.add_argument("--out", default="chapters/02-kv-cache/sampling.png")
    ap.add_argument("--show", type=int, default=25, help="tokens on the x axis")
    args = ap.parse_args()
    path = resolve_model_dir(DEFAULT_MODEL)
    cfg = read_model_config(path)
    model = load_model(path, cfg, torch.device("cpu"), torch.float32)
    tokenizer = Tokenizer.from_model_dir(path, cfg.vocab_size)
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer.encode(args.prompt)]))[0, -1]  # the dense forward: [V]

    def filtered(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
        p = torch.softmax(logits / temperature, dim=-1)
        sp, order = p.sort(descending=True)
        keep = (torch.arange(len(sp)) < top_k) & (sp.cumsum(0) - sp < top_p)
        out = torch.zeros_like(p)
        out[order[keep]] = sp[keep]
        return out / out.sum()

    base = torch.softmax(logits, dim=-1)
    top = base.argsort(descending=True)[: args.show]
    labels = [repr(tokenizer.decode([int(t)]))[1:-1] for t in top]
    panels = [
        ("temperature 1.0 (raw)", base),
        ("temperature 0.7", filtered(0.7, len(base), 1.0)),
        ("temperature 1.0, top_k 5", filtered(1.0, 5, 1.0)),
        ("temperature 1.0, top_p 0.8", filtered(1.0, len(base), 0.8)),
    ]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 8), sharex=True)
    for ax, (title, p) in zip(axes, panels, strict=True):
        vals = p[top].numpy()
        ax.bar(range(len(top)), vals, color=["#b5172b" if v > 0 else "#cccccc" for v in vals])
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("p")
        kept = int((p > 0).sum())
        ax.text(0.99, 0.85, f"{kept} tokens can be drawn", transform=ax.transAxes, ha="right", fontsize=9)
    axes[-1].set_xticks(range(len(top)), labels, rotation=60, fontsize=8)
    fig.suptitle(f"next token after {args.prompt.splitlines()[-1]!r}", fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    for title, p in panels:
        print(f"{title:28} tokens with p > 0: {int((p > 0).sum()):5d}  top-1 p = {p.max():.3f}")


if __name__ == "__main__":
    main()
