"""A chapter as scripts/check_chapters.py reads it, and the repo's files at a stage.

    chapters/NN-slug/README.md ──read_document──► Document
                                                    .prose    [(line, text)]        outside code blocks
                                                    .blocks   [Block(start, lang, lines, mark)]
    `Stage: NN-slug` trailers ──stage_commits──► {"NN-slug": commit}
    Snapshots().text(commit, path)             ► the file's lines at that commit (`git show`), None if absent

Line numbers are the chapter's, 1-based; a block's `start` is the line of its first content line (the
line after the opening fence), so `start + i` is the line of `lines[i]`.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import git

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^\s*(`{3,})\s*([\w+-]*)")
# `# roseinfer/engine.py`: one path-like word (a folder or a file extension) and nothing else
HEADER = re.compile(r"^#\s*((?:[\w.-]+/)*[\w.-]*\w\.\w+|(?:[\w.-]+/)+[\w.-]+)\s*$")
ELISION = "..."
# `<!-- output: CMD -->` or `<!-- output (timed): CMD -->` on the last line before a fence
OUTPUT_MARK = re.compile(r"^\s*<!--\s*output\s*(\(timed\))?\s*:\s*(.+?)\s*-->\s*$")
SHELL = {"bash", "sh", "shell", "console"}
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s")


@dataclass
class Block:
    start: int
    lang: str
    lines: list[str]
    mark: str | None = None  # the command of an output mark just before the fence
    timed: bool = False  # the mark says `(timed)`: the output's decimal numbers are timings

    @property
    def excerpt_of(self) -> str | None:
        """The repo file an excerpt block names in its first line, else None."""
        m = HEADER.match(self.lines[0].strip()) if self.lines else None
        return m.group(1) if m else None


@dataclass
class Document:
    path: Path
    blocks: list[Block] = field(default_factory=list)
    prose: list[tuple[int, str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path)

    def lines(self) -> list[tuple[int, str]]:
        """Every (line, text) of the prose and of the blocks."""
        return self.prose + [(b.start + i, t) for b in self.blocks for i, t in enumerate(b.lines)]

    def section(self, line: int) -> str:
        """The `## ` heading a line is under."""
        return next((t[3:].strip() for n, t in reversed(self.prose) if n < line and t.startswith("## ")), "")

    def paragraph(self, line: int) -> str:
        """The prose paragraph a line is in (in a list, its item); for a line inside or at a block, the
        paragraph above the block."""
        text = dict(self.prose)
        start = (
            line if text.get(line, "").strip() else max((n for n in text if n < line and text[n].strip()), default=0)
        )
        first = last = start
        while text.get(first - 1, "").strip() and not LIST_ITEM.match(text[first]):
            first -= 1
        while text.get(last + 1, "").strip() and not LIST_ITEM.match(text[last + 1]):
            last += 1
        return " ".join(text[n] for n in range(first, last + 1) if n in text)


def read_document(path: Path) -> Document:
    doc = Document(path)
    current: Block | None = None
    fence, indent, mark = "", 0, None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        m = FENCE.match(line)
        if current is None:
            if m:
                fence, indent = m.group(1), len(line) - len(line.lstrip(" "))
                current = Block(
                    number + 1, m.group(2).lower(), [], mark.group(2) if mark else None, bool(mark and mark.group(1))
                )
            else:
                doc.prose.append((number, line))
                mark = OUTPUT_MARK.match(line) or (mark if not line.strip() else None)
        elif m and line.strip() == m.group(1) and m.group(1).startswith(fence):
            doc.blocks.append(current)
            current, mark = None, None
        else:  # a fence indented inside a list item: its lines carry that indentation too
            current.lines.append(line[min(indent, len(line) - len(line.lstrip(" "))) :])
    return doc


def stage_commits() -> dict[str, str]:
    """`NN-slug` -> commit, from the `Stage:` trailers in HEAD's history (newest wins), as tag_stages.sh reads them."""
    out = git("log", "--format=%H%x09%(trailers:key=Stage,valueonly,separator=%x2C)", "HEAD")
    commits: dict[str, str] = {}
    for line in out.splitlines():
        sha, _, stages = line.partition("\t")
        for stage in stages.split(","):
            if stage.strip():
                commits.setdefault(stage.strip(), sha)
    return commits


def stage_number(stage: str) -> int:
    return int(stage.split("-", 1)[0])


def previous_commit(stage: str, commits: dict[str, str]) -> str | None:
    """The commit of the highest-numbered stage below `stage`."""
    below = sorted((stage_number(s), c) for s, c in commits.items() if stage_number(s) < stage_number(stage))
    return below[-1][1] if below else None


def commit_of_number(number: str, commits: dict[str, str]) -> str | None:
    return next((c for s, c in commits.items() if s.startswith(number + "-")), None)


class Snapshots:
    """Repo files at a commit (None = the working tree), each read once; `memo` keeps what is derived from them."""

    def __init__(self) -> None:
        self._text: dict[tuple[str | None, str], list[str] | None] = {}
        self.memo: dict = {}

    def text(self, commit: str | None, path: str) -> list[str] | None:
        key = (commit, path)
        if key not in self._text:
            if commit is None:
                file = REPO / path
                self._text[key] = file.read_text(encoding="utf-8").splitlines() if file.is_file() else None
            else:
                proc = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO, capture_output=True)
                self._text[key] = proc.stdout.decode("utf-8").splitlines() if proc.returncode == 0 else None
        return self._text[key]

    def exists(self, commit: str | None, path: str) -> bool:
        if commit is None:
            return (REPO / path).exists()
        return (
            subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=REPO, capture_output=True).returncode == 0
        )

    def listing(self, commit: str | None, folder: str) -> list[str]:
        """The names of the files in a folder at a commit."""
        if commit is None:
            return sorted(p.name for p in (REPO / folder).glob("*"))
        return sorted(Path(p).name for p in git("ls-tree", "--name-only", commit, f"{folder}/").split())
