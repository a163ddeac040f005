"""How long a chapter is to read, counted, and the README's "How long it takes" kept equal to the count.

    python -m tools.chapters.length          # each chapter's words: the reading part, Measured, and minutes

A chapter has two parts: the reading part (from the top to the end of the section before Measured: the
problem, the idea, the code, how to run and check it) and Measured, its closing record of numbers. Words are
counted as `wc -w` counts them (runs of non-space characters), code blocks included, since a reader reads
those too; minutes are words / 200, rounded up.

Rules, each failure printed as `file:line: why`:

1. A chapter's reading part has at most READING_MAX words (20 minutes), and its Measured section at most
   MEASURED_MAX. The numbers a reader needs, with their commands and Data: lines, fit in that; the long
   form of a measurement (every run's notes, full tables, the intermediate experiments) goes to
   results/NN-slug/README.md, which the section links.
2. README.md's "How long it takes" paragraph states the shortest and longest reading part in words, the
   minutes they take, and the hours of the core path's and of all chapters' reading parts; each number
   must be the one this module counts, so the README cannot fall behind the chapters.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from tools.chapters.doc import REPO

READING_MAX = 4000
MEASURED_MAX = 2000
WORDS_PER_MINUTE = 200
CORE_PATH = ["01", "02", "03", "05", "06", "07", "09", "10", "14", "16", "18"]
MEASURED = re.compile(r"^## \d+\. Measured\b")


@dataclass
class Length:
    stage: str  # NN-slug
    reading: int  # words before Measured
    measured: int  # words of Measured, its heading to the end of the file
    measured_line: int  # 1-based line of the Measured heading (0: none)

    @property
    def minutes(self) -> int:
        return math.ceil(self.reading / WORDS_PER_MINUTE)


def count(path: Path) -> Length:
    """One chapter's reading part and Measured section, in words."""
    lines = path.read_text(encoding="utf-8").splitlines()
    at = next((i for i, line in enumerate(lines) if MEASURED.match(line)), len(lines))
    reading = sum(len(line.split()) for line in lines[:at])
    measured = sum(len(line.split()) for line in lines[at:])
    return Length(path.parent.name, reading, measured, at + 1 if at < len(lines) else 0)


def chapters() -> list[Length]:
    return [count(p) for p in sorted(REPO.glob("chapters/[0-9][0-9]-*/README.md"))]


def hours(lengths: list[Length]) -> float:
    """Reading time in hours, to the half hour."""
    return round(sum(x.reading for x in lengths) / WORDS_PER_MINUTE / 60 * 2) / 2


def summary(lengths: list[Length]) -> dict[str, float]:
    """The numbers README.md's "How long it takes" states."""
    core = [x for x in lengths if x.stage[:2] in CORE_PATH]
    shortest = min(lengths, key=lambda x: x.reading)
    longest = max(lengths, key=lambda x: x.reading)
    return {
        "shortest words": shortest.reading,
        "longest words": longest.reading,
        "shortest minutes": shortest.minutes,
        "longest minutes": longest.minutes,
        "core hours": hours(core),
        "all hours": hours(lengths),
        "chapters": len(lengths),
    }


# "... reading part is 2,001 to 4,400 words (...): 11 to 22 minutes ... The core path ... about 3.5 hours of
# reading, all 22 chapters about 6.5." (the paragraph may wrap anywhere)
README_CLAIM = re.compile(
    r"reading\s+part\s+is\s+(?P<sw>[\d,]+)\s+to\s+(?P<lw>[\d,]+)\s+words.*?:\s+(?P<sm>\d+)\s+to\s+(?P<lm>\d+)\s+minutes"
    r".*?core\s+path\s+below\s+is\s+about\s+(?P<ch>\d+(?:\.\d+)?)\s+hours.*?all\s+(?P<n>\d+)\s+chapters\s+about\s+"
    r"(?P<ah>\d+(?:\.\d+)?)",
    re.S,
)


def check_length(path: Path) -> list[str]:
    """Rule 1 for one chapter."""
    x = count(path)
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    failures = []
    if x.reading > READING_MAX:
        failures.append(f"{rel}:1: the reading part (before Measured) has {x.reading} words, more than {READING_MAX}")
    if x.measured > MEASURED_MAX:
        failures.append(
            f"{rel}:{x.measured_line}: Measured has {x.measured} words, more than {MEASURED_MAX}: keep the numbers "
            f"a reader needs with their commands and Data: lines, and move the long form to results/{x.stage}/README.md"
        )
    return failures


def check_readme(readme: Path, lengths: list[Length]) -> list[str]:
    """Rule 2: README.md's reading times are this module's counts."""
    text = readme.read_text(encoding="utf-8")
    m = README_CLAIM.search(text)
    if m is None:
        return [f'{readme.name}:1: no "How long it takes" sentence with the reading part\'s words and hours']
    line = text[: m.start()].count("\n") + 1
    want = summary(lengths)
    said = {
        "shortest words": int(m["sw"].replace(",", "")),
        "longest words": int(m["lw"].replace(",", "")),
        "shortest minutes": int(m["sm"]),
        "longest minutes": int(m["lm"]),
        "core hours": float(m["ch"]),
        "all hours": float(m["ah"]),
        "chapters": int(m["n"]),
    }
    return [
        f"{readme.name}:{line}: it says {key} {said[key]:g}, the chapters count {want[key]:g} "
        "(python -m tools.chapters.length)"
        for key in want
        if said[key] != want[key]
    ]


def main() -> int:
    lengths = chapters()
    print(f"{'chapter':32} {'reading':>8} {'minutes':>8} {'measured':>9}")
    for x in lengths:
        print(f"{x.stage:32} {x.reading:8,} {x.minutes:8} {x.measured:9,}")
    for key, value in summary(lengths).items():
        print(f"{key}: {value:,g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
