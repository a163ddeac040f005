"""Check that every code excerpt in a chapter is really in the code of that chapter's stage.

    python scripts/check_chapters.py              # every chapters/NN-slug/README.md
    python scripts/check_chapters.py chapters/03-offline-scheduler/README.md

The convention. A fenced code block (any language) whose FIRST line is a comment naming a repo
file, such as `# roseinfer/engine.py`, is an excerpt of that file:

- every other non-blank line, stripped of leading and trailing whitespace, must equal some
  line of that file (also stripped); a line that is exactly `...` or `# ...` marks an elision
  and is skipped;
- in a ```diff block, a line starting with `+` or ` ` (after removing that one-character
  prefix) must be in the file at the chapter's stage, a line starting with `-` must be in the
  file at the previous stage, and `@@` lines are skipped.

The file is read at the chapter's stage: the commit whose trailer is `Stage: NN-slug` for
`chapters/NN-slug/` (found in `git log` like scripts/tag_stages.sh does, so no tags are needed).
A chapter whose stage has no commit yet is checked against the working tree. The previous stage
is the highest-numbered stage below NN that has a commit.

Every failing line is printed with its chapter, line number and file; the exit status is 1 if
any line fails.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^\s*(`{3,})\s*([\w+-]*)")
# `# roseinfer/engine.py`: one path-like word (a folder or a file extension) and nothing else
HEADER = re.compile(r"^#\s*((?:[\w.-]+/)*[\w.-]*\w\.\w+|(?:[\w.-]+/)+[\w.-]+)\s*$")
ELISIONS = {"...", "# ..."}


@dataclass
class Block:
    chapter: Path
    start: int  # 1-based line number, in the chapter, of the block's first content line
    lang: str
    lines: list[str]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def stage_commits() -> dict[str, str]:
    """`NN-slug` -> commit, from the `Stage:` trailers in HEAD's history (newest wins)."""
    out = git("log", "--format=%H%x09%(trailers:key=Stage,valueonly,separator=%x2C)", "HEAD")
    commits: dict[str, str] = {}
    for line in out.splitlines():
        sha, _, stages = line.partition("\t")
        for stage in stages.split(","):
            if stage.strip():
                commits.setdefault(stage.strip(), sha)
    return commits


class Snapshots:
    """Lines of repo files at a commit (None = the working tree), read once each."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str | None, str], set[str] | None] = {}

    def lines(self, commit: str | None, path: str) -> set[str] | None:
        key = (commit, path)
        if key not in self._cache:
            self._cache[key] = self._read(commit, path)
        return self._cache[key]

    @staticmethod
    def _read(commit: str | None, path: str) -> set[str] | None:
        if commit is None:
            file = REPO / path
            text = file.read_text(encoding="utf-8") if file.is_file() else None
        else:
            proc = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO, capture_output=True)
            text = proc.stdout.decode("utf-8") if proc.returncode == 0 else None
        return None if text is None else {line.strip() for line in text.splitlines()}


def code_blocks(chapter: Path) -> list[Block]:
    blocks: list[Block] = []
    current: Block | None = None
    fence = ""
    indent = 0  # a fence indented inside a list item: its lines carry that indentation too
    for number, line in enumerate(chapter.read_text(encoding="utf-8").splitlines(), start=1):
        m = FENCE.match(line)
        if current is None:
            if m:
                fence, current = m.group(1), Block(chapter, number + 1, m.group(2).lower(), [])
                indent = len(line) - len(line.lstrip(" "))
        elif m and line.strip() == m.group(1) and m.group(1).startswith(fence):
            blocks.append(current)
            current = None
        else:
            drop = min(indent, len(line) - len(line.lstrip(" ")))
            current.lines.append(line[drop:])
    return blocks


def check_chapter(chapter: Path, commits: dict[str, str], files: Snapshots) -> list[str]:
    """Every failing excerpt line of one chapter, as `chapter:line: file: why`."""
    stage = chapter.parent.name  # NN-slug
    commit = commits.get(stage)
    number = int(stage.split("-", 1)[0])
    below = sorted((int(s.split("-", 1)[0]), c) for s, c in commits.items() if int(s.split("-", 1)[0]) < number)
    previous = below[-1][1] if below else None
    where = commit[:10] if commit else "the working tree"
    name = chapter.relative_to(REPO) if chapter.is_relative_to(REPO) else chapter
    failures: list[str] = []
    for block in code_blocks(chapter):
        if not block.lines:
            continue
        m = HEADER.match(block.lines[0].strip())
        if not m:
            continue
        path = m.group(1)
        now = files.lines(commit, path)
        if now is None:
            failures.append(f"{name}:{block.start}: {path} does not exist at stage {stage} ({where})")
            continue
        for offset, raw in enumerate(block.lines[1:], start=1):
            at = f"{name}:{block.start + offset}: {path}"
            if not raw.strip():
                continue
            want, side, label = raw, now, f"stage {stage} ({where})"
            if block.lang == "diff":
                if raw.startswith("@@"):
                    continue
                if raw[:1] in "+ -":
                    want = raw[1:]
                if raw.startswith("-"):
                    if previous is None:
                        failures.append(f"{at}: a removed line, but no stage comes before {stage}")
                        continue
                    side = files.lines(previous, path)
                    label = f"the previous stage ({previous[:10]})"
                    if side is None:
                        failures.append(f"{at}: the file does not exist at {label}")
                        continue
            want = want.strip()
            if not want or want in ELISIONS:
                continue
            if want not in side:
                failures.append(f"{at}: not in the file at {label}: {want}")
    return failures


def main(argv: list[str]) -> int:
    chapters = [Path(a).resolve() for a in argv] or sorted(REPO.glob("chapters/[0-9][0-9]-*/README.md"))
    commits, files = stage_commits(), Snapshots()
    failures: list[str] = []
    excerpts = 0
    for chapter in chapters:
        excerpts += sum(1 for b in code_blocks(chapter) if b.lines and HEADER.match(b.lines[0].strip()))
        failures += check_chapter(chapter, commits, files)
    for failure in failures:
        print(failure)
    print(f"{len(chapters)} chapters, {excerpts} excerpts, {len(failures)} failing lines")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
