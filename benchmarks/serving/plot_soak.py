"""A soak's resident memory over time, one line per soak, from the JSON files `soak_serving.py --json` writes.

    python benchmarks/serving/plot_soak.py "no warm-up=a.json" "warm-up=b.json" --out soak_rss.png

Each argument is LABEL=FILE. For each soak it prints the first and last sample and the slope that soak_serving.py
judges (`rss_slope`: least squares over the samples after the first 20% of the run), so the figure's numbers
are in the output too; the figure draws RSS in MiB against minutes, the fitted line over the span it covers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.serving.soak_serving import rss_slope


def read(spec: str) -> tuple[str, list[tuple[float, float]]]:
    """LABEL=FILE -> (label, [(seconds, MiB), ...])."""
    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
        raise SystemExit(f"{spec!r}: want LABEL=FILE")
    samples = json.loads(Path(path).read_text()).get("rss_samples")
    if not samples:
        raise SystemExit(f"{path}: no rss_samples (write it with soak_serving.py --json)")
    return label, [(float(t), float(mib)) for t, mib in samples]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("soaks", nargs="+", metavar="LABEL=FILE")
    ap.add_argument("--out", type=Path, required=True, help="the figure (.png)")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for spec in args.soaks:
        label, samples = read(spec)
        fitted = rss_slope(samples)
        slope = f"{fitted[0]:+.2f} MiB/min from {fitted[1]:.0f} s" if fitted else "too few samples to fit"
        print(f"{label}: {len(samples)} samples, {samples[0][1]:.1f} -> {samples[-1][1]:.1f} MiB; slope {slope}")
        line = ax.plot([t / 60 for t, _ in samples], [m for _, m in samples], label=f"{label} ({slope})")[0]
        if fitted:
            rate, t0 = fitted
            fit = [(t, m) for t, m in samples if t >= t0]
            mean_t, mean_m = sum(t for t, _ in fit) / len(fit), sum(m for _, m in fit) / len(fit)
            ends = [t0, samples[-1][0]]
            ax.plot([t / 60 for t in ends], [mean_m + rate * (t - mean_t) / 60 for t in ends], "--",
                    color=line.get_color(), linewidth=1)  # fmt: skip
    ax.set_xlabel("minutes")
    ax.set_ylabel("server RSS (MiB)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
