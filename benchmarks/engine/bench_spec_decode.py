"""Chapter 14's numbers: what speculative decoding buys on this CPU, and what it would buy on an H100.

    python benchmarks/engine/bench_spec_decode.py                      # n-gram and the draft model at batch 1 / 8 / 32
    python benchmarks/engine/bench_spec_decode.py --threads 1
    python benchmarks/engine/bench_spec_decode.py --part paper         # only the on-paper H100 table

Part "cpu" (measured): output tokens per second of plain decoding and of speculative decoding on the same
requests, in the same run, median of --repeats runs each (greedy, ignore_eos: every run makes the same
tokens). Workload `repetitive`: prompts that quote earlier lines, then start to quote them again (text
the n-gram proposer can find in the prompt). Workload `plays`: short openings of scenes (nothing to look
up; the draft model has to guess). Prints the speed ratio against plain decoding and the acceptance
statistics of every speculative run.

Part "paper" (computed, not measured): the same trade on an H100 SXM (3.35 TB/s HBM3, 989 TFLOP/s dense
bf16) for GPT-2 XL (1.56 B parameters) drafted by GPT-2 small (124 M), in bf16. A decode step reads every
weight once, so its time is max(weight bytes / bandwidth, FLOPs / peak): a forward over B · (k + 1) tokens
costs the same as over B tokens until it becomes compute-bound. The acceptance length is the one measured
with the bundled pair in part "cpu" (an assumption: a real pair's acceptance depends on the pair).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
from roseinfer import LLM, SamplingParams  # noqa: E402

DRAFT = str(REPO / "roseinfer" / "models" / "tiny-shakespeare-draft")
QUOTES = [
    ("KING.", "Thou art the ruler of this land, and I thy servant."),
    ("QUEEN.", "Then serve me well, and I will make thee great."),
    ("ROMEO.", "But soft, what light through yonder window breaks?"),
    ("JULIET.", "O Romeo, Romeo, wherefore art thou Romeo?"),
    ("HAMLET.", "To be, or not to be, that is the question."),
    ("OPHELIA.", "Good my lord, how does your honour for this many a day?"),
    ("MACBETH.", "Is this a dagger which I see before me?"),
    ("LADY MACBETH.", "Out, damned spot! out, I say!"),
]
SCENES = ["Enter the King and Queen.\n", "SCENE II. A street.\n\nEnter", "First Citizen.\n", "Enter Romeo.\n\nROMEO.\n"]
H100_BYTES_PER_S, H100_FLOPS = 3.35e12, 989e12
PAIRS = {"GPT-2 XL + GPT-2 small": (1.56e9, 124e6)}


def workload(name: str, n: int) -> list[str]:
    if name == "repetitive":  # two speeches, then the first again, cut after its speaker's name
        prompts = []
        for i in range(n):
            (a, la), (b, lb) = QUOTES[i % len(QUOTES)], QUOTES[(i + 1) % len(QUOTES)]
            prompts.append(f"{a}\n{la}\n{b}\n{lb}\n{a}\n{la}\n{b}\n{lb}\n{a}\n")
        return prompts
    return [SCENES[i % len(SCENES)] for i in range(n)]


def run(llm: LLM, prompts: list[str], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    return sum(len(o.token_ids) for o in outs) / elapsed


def measure(spec: dict | None, prompts: list[str], batch: int, max_tokens: int, repeats: int) -> dict:
    llm = LLM(device="cpu", dtype="float32", max_num_seqs=batch, num_blocks=2048, speculative_config=spec)
    run(llm, prompts[:1], 8)  # warm up
    before = llm.llm_engine.get_stats() if spec else {}
    steps, t = llm.llm_engine.num_steps, time.perf_counter()
    speeds = [run(llm, prompts, max_tokens) for _ in range(repeats)]
    step_ms = (time.perf_counter() - t) / (llm.llm_engine.num_steps - steps) * 1e3  # mean time of one engine step
    row = {"tok_s": statistics.median(speeds), "runs": speeds, "step_ms": step_ms}
    if spec:
        s = llm.llm_engine.get_stats()
        drafts = s["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        proposed = s["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = s["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        old, new = before["spec_decode_num_accepted_tokens_per_pos"], s["spec_decode_num_accepted_tokens_per_pos"]
        per_pos = [n - (old[i] if i < len(old) else 0) for i, n in enumerate(new)]
        row |= {"acceptance": accepted / max(proposed, 1), "mean_len": 1 + accepted / max(drafts, 1),
                "per_pos": [n / max(drafts, 1) for n in per_pos]}  # fmt: skip
    return row


def part_cpu(args) -> dict:
    results = {}
    cases = []
    for batch in args.batch:
        cases.append(("repetitive", batch, [None] + [{"method": "ngram", "num_speculative_tokens": k} for k in args.k]))
    for batch in args.batch:
        cases.append(("plays", batch, [None] + [{"method": "draft_model", "model": DRAFT, "num_speculative_tokens": k}
                                                for k in args.k]))  # fmt: skip
    for name, batch, specs in cases:
        prompts = workload(name, batch)
        base = None
        print(f"\n{name}, batch {batch}, {args.max_tokens} tokens each, threads {torch.get_num_threads()}")
        print(f"  {'proposer':<14} {'k':>2} {'tok/s':>8} {'vs plain':>8} {'step ms':>8} {'accept':>7} {'mean len':>8}"
              "  accepted at position 1, 2, ...")  # fmt: skip
        for spec in specs:
            row = measure(spec, prompts, batch, args.max_tokens, args.repeats)
            base = base or row["tok_s"]
            label = spec["method"] if spec else "plain"
            k = spec["num_speculative_tokens"] if spec else 0
            extra = ""
            if spec:
                pos = " ".join(f"{x:.2f}" for x in row["per_pos"][:k])
                extra = f" {row['acceptance']:>7.2f} {row['mean_len']:>8.2f}  {pos}"
            speed = f"{row['tok_s']:>8.1f} {row['tok_s'] / base:>7.2f}x {row['step_ms']:>8.1f}"
            print(f"  {label:<14} {k:>2} {speed}{extra}", flush=True)
            results[(name, batch, label, k)] = row
    return results


def part_paper(mean_len: dict[int, float]) -> None:
    """Step time = max(bytes / bandwidth, FLOPs / peak) per forward, bf16, weights only (short contexts)."""
    print("\nOn paper: H100 SXM, bf16, weights read once per forward (KV reads left out: short contexts)")
    for pair, (big, small) in PAIRS.items():
        print(f"  {pair}: speculative / plain output tokens per second, by batch size (k: drafts per step)")
        print(f"  {'batch':>6} " + " ".join(f"{'k=' + str(k) + ' (len ' + format(mean_len[k], '.2f') + ')':>18}"
                                            for k in mean_len))  # fmt: skip
        for batch in (1, 8, 32, 64, 128, 256):
            cells = []
            for k, length in mean_len.items():
                plain = max(2 * big / H100_BYTES_PER_S, 2 * big * batch / H100_FLOPS)  # one token per request
                verify = max(2 * big / H100_BYTES_PER_S, 2 * big * batch * (k + 1) / H100_FLOPS)
                drafts = k * max(2 * small / H100_BYTES_PER_S, 2 * small * batch / H100_FLOPS)
                cells.append(f"{length * plain / (verify + drafts):>17.2f}x")
            print(f"  {batch:>6} " + " ".join(cells))


def plot(path: str, measured: dict[str, dict[int, float]]) -> None:
    """Tokens per verifying step against k: (1 - a^(k+1)) / (1 - a) if every draft passes with probability a
    independently, and what the two proposers achieved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = list(range(0, 9))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for a in (0.5, 0.7, 0.8, 0.9):
        ax.plot(ks, [(1 - a ** (k + 1)) / (1 - a) for k in ks], color="0.6", lw=1)
        ax.annotate(f"a = {a}", (8, (1 - a**9) / (1 - a)), xytext=(4, 0), textcoords="offset points", fontsize=8)
    for (label, points), marker in zip(measured.items(), "os", strict=False):
        ax.plot(list(points), list(points.values()), marker=marker, lw=2, label=f"measured: {label}")
    ax.plot(ks, [k + 1 for k in ks], ls=":", color="0.3", label="every draft accepted (k + 1)")
    ax.set_xlabel("k, drafts per step")
    ax.set_ylabel("tokens per verifying step")
    ax.set_xlim(0, 9.2)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("Acceptance length: theory for acceptance rate a, and measured (greedy)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")


def profile(args) -> None:
    """Where a step's time goes, plain and speculative (batch 1, k = 4): cProfile's cumulative times per engine
    step of the parts that matter (the linear layers and attention of every forward, target and draft)."""
    import cProfile
    import pstats

    parts = {("~", "<built-in method torch._C._nn.linear>"): "linear layers (all forwards)",
             ("~", "<built-in method torch._C._nn.scaled_dot_product_attention>"): "attention (SDPA)",
             ("draft_model.py", "propose"): "DraftModelProposer.propose",
             ("ngram.py", "propose"): "NgramProposer.propose",
             ("model_runner.py", "execute_model"): "ModelRunner.execute_model (+ propose)",
             ("rejection_sampler.py", "rejection_sample"): "rejection_sample"}  # fmt: skip
    ngram, draft = {"method": "ngram"}, {"method": "draft_model", "model": DRAFT}
    runs = [("plain", None, "repetitive"), ("ngram", {**ngram, "num_speculative_tokens": 4}, "repetitive"),
            ("draft model", {**draft, "num_speculative_tokens": 4}, "plays")]  # fmt: skip
    print(f"cProfile, batch 1, {args.max_tokens} tokens, threads {torch.get_num_threads()}: ms per engine step")
    print(f"  {'':40s}" + "".join(f"{name:>14s}" for name, _, _ in runs))
    table: dict[str, list[str]] = {label: [] for label in ["steps", "ms per step", *parts.values()]}
    for _, spec, work in runs:
        llm = LLM(device="cpu", dtype="float32", max_num_seqs=1, num_blocks=2048, speculative_config=spec)
        prompts = workload(work, 1)
        run(llm, prompts, 8)  # warm up
        steps = llm.llm_engine.num_steps
        prof = cProfile.Profile()
        prof.runcall(run, llm, prompts, args.max_tokens)
        steps = llm.llm_engine.num_steps - steps
        stats = pstats.Stats(prof).stats
        found = {(Path(file).name, fn): ct for (file, _, fn), (_, _, _, ct, _) in stats.items()}
        total = max(ct for ct in found.values())
        table["steps"].append(f"{steps:14d}")
        table["ms per step"].append(f"{total / steps * 1e3:14.2f}")
        for key, label in parts.items():
            table[label].append(f"{found[key] / steps * 1e3:14.2f}" if key in found else f"{'-':>14s}")
    for label, cells in table.items():
        print(f"  {label:40s}" + "".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "cpu", "paper"], default="all")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--figure", default=None, help="plot the acceptance length against k (theory + measured) here")
    ap.add_argument("--profile", action="store_true", help="cProfile plain, n-gram and draft runs (batch 1) and stop")
    ap.add_argument("--mean-len", type=float, nargs="+", default=None,
                    help="paper part alone: acceptance lengths for each --k (default: measured)")  # fmt: skip
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        return profile(args)
    mean_len = dict(zip(args.k, args.mean_len or [], strict=False))
    if args.part in ("all", "cpu"):
        results = part_cpu(args)
        mean_len = {k: results[("plays", args.batch[0], "draft_model", k)]["mean_len"] for k in args.k}
        if args.figure:
            ngram_len = {k: results[("repetitive", 1, "ngram", k)]["mean_len"] for k in args.k}
            plot(args.figure, {"n-gram, repetitive": ngram_len, "draft model, plays": mean_len})
    if args.part in ("all", "paper"):
        if not mean_len:
            raise SystemExit("--part paper needs --mean-len (one per --k), or run --part all")
        part_paper(mean_len)


if __name__ == "__main__":
    main()
