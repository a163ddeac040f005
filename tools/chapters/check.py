"""Check that a chapter says only what the code, tests and scripts of its stage bear out.

    python scripts/check_chapters.py                  # every chapters/NN-slug/README.md, and README.md
    python scripts/check_chapters.py 03 chapters/04-kv-block-manager/README.md
    python scripts/check_chapters.py --outputs 01 03  # slow: rerun the marked outputs of chapters 01 and 03
    python scripts/check_chapters.py --sync-data 05   # copy results/05-*/ outputs into the blocks that show them

A chapter is checked against its stage: the commit whose trailer is `Stage: NN-slug` for `chapters/NN-slug/`
(found in `git log` as scripts/tag_stages.sh does, so no tags are needed); a chapter whose stage has no commit
yet, against the working tree. Files are read with `git show`, so the default mode takes seconds.

| what        | the rule                                                              | where             |
|-------------|-----------------------------------------------------------------------|-------------------|
| excerpts    | a block whose first line names a file (`# roseinfer/engine.py`) is a  | excerpts.py       |
|             | contiguous run of that file, in order; a line that is only `...` is   |                   |
|             | the one way to leave lines out; a ```diff block's `-` lines are the   |                   |
|             | previous stage's                                                      |                   |
| names       | every test named (`test_x`, `tests/test_f.py::test_x`, `-k` words),   | names.py          |
|             | script run (`./x.sh`, `python scripts/x.py`) and `stage-NN-slug`      |                   |
|             | exists at the stage                                                   |                   |
| words       | no goal-talk or placeholders in the prose, no local paths; output     | words.py          |
|             | marks name a command shown above them; README.md's Layout block lists |                   |
|             | every module                                                          |                   |
| outputs     | `<!-- output: CMD -->` before a block: rerun CMD at the stage and     | outputs.py        |
|             | compare (`--outputs` only)                                            |                   |
| links       | Previous/Next links to the chapters on either side, and a shell block | links.py          |
|             | with `git diff stage-<previous> stage-<this>`                         |                   |
| sections    | Run this chapter, then numbered sections 1..N: the problem, the idea, | sections.py       |
|             | the walkthrough, Run it, Check yourself, Exercises, Build it          |                   |
|             | yourself, what the next stage fixes, and Measured last                |                   |
| gpu claims  | no sentence states GPU behaviour as fact ("runs on the GPU", "7.5 µs  | gpu_claims.py     |
|             | on an H100") unless it or its paragraph says it was never run, is on  |                   |
|             | paper, written for a GPU, a bound; chapters and README.md             |                   |
| length      | the reading part has at most 4,000 words, Measured at most 2,000 (the | length.py         |
|             | long form goes to results/NN-slug/README.md); README.md's reading     |                   |
|             | times are the counts                                                  |                   |
| data        | a section with a measured number (a rate, a time, a ratio) has a      | data.py           |
|             | `Data:` line naming files under results/ that reproduce.py wrote      |                   |
|             | from a command the chapter shows; a block after the line is the       |                   |
|             | file's output (`--sync-data` rewrites it from the file)               |                   |

Each module's docstring has its rules in full. Every failure is printed as `file:line: why`; the exit status
is 1 if there is any.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from tools.chapters.data import check_data, sync
from tools.chapters.doc import REPO, Block, Snapshots, previous_commit, read_document, stage_commits
from tools.chapters.excerpts import check_excerpts, match_excerpt
from tools.chapters.gpu_claims import check_gpu_claims
from tools.chapters.length import chapters as chapter_lengths
from tools.chapters.length import check_length, check_readme
from tools.chapters.links import check_links
from tools.chapters.names import check_names
from tools.chapters.sections import check_sections
from tools.chapters.words import check_layout, check_marks, check_words, goal_talk

__all__ = ["Snapshots", "check_chapter", "code_blocks", "goal_talk", "main", "match_excerpt", "stage_commits"]


def code_blocks(chapter: Path) -> list[Block]:
    return read_document(chapter).blocks


def check_chapter(chapter: Path, commits: dict[str, str], files: Snapshots) -> list[str]:
    """Every failure of one chapter (all but its outputs), as `chapter:line: why`."""
    doc = read_document(chapter)
    stage = chapter.parent.name  # NN-slug
    return (
        check_excerpts(doc, stage, commits.get(stage), previous_commit(stage, commits), files)
        + check_names(doc, stage, commits, files)
        + check_words(doc)
        + check_marks(doc)
        + check_data(doc)
        + check_links(doc, stage)
        + check_sections(doc, stage)
        + check_gpu_claims(doc)
        + check_length(chapter)
    )


def chapter_paths(args: list[str]) -> list[Path]:
    """`chapters/NN-x/README.md`, `chapters/NN-x` or `NN`; none: every chapter."""
    every = sorted(REPO.glob("chapters/[0-9][0-9]-*/README.md"))
    out: list[Path] = []
    for arg in args:
        if re.fullmatch(r"\d\d?", arg):
            out += [c for c in every if c.parent.name.startswith(f"{int(arg):02d}-")]
        else:
            path = Path(arg).resolve()
            out.append(path / "README.md" if path.is_dir() else path)
    return out or every


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*", help="chapter READMEs, folders or numbers (default: all)")
    parser.add_argument("--outputs", action="store_true", help="rerun the marked outputs at their stage (slow)")
    parser.add_argument("--workdir", type=Path, help="with --outputs: keep the stage worktrees in this folder")
    parser.add_argument("--sync-data", action="store_true", help="rewrite the blocks after Data: lines from results/")
    parser.add_argument("--timeout", type=int, default=900, help="with --outputs: seconds per command")
    args = parser.parse_args(argv)
    chapters = chapter_paths(args.chapters)
    commits = stage_commits()
    if args.outputs:
        from tools.chapters import outputs as chapter_outputs

        return chapter_outputs.main(chapters, commits, args.workdir, args.timeout)
    if args.sync_data:
        docs = [read_document(c) for c in chapters] + ([] if args.chapters else [read_document(REPO / "README.md")])
        for doc in docs:
            if changed := sync(doc):
                print(f"{doc.name}: {changed} blocks rewritten from results/")
        return 0
    files = Snapshots()
    failures: list[str] = []
    for chapter in chapters:
        failures += check_chapter(chapter, commits, files)
    if not args.chapters:
        readme = read_document(REPO / "README.md")
        failures += check_words(readme) + check_marks(readme) + check_layout(readme) + check_data(readme)
        failures += check_gpu_claims(readme) + check_readme(REPO / "README.md", chapter_lengths())
    excerpts = sum(1 for c in chapters for b in code_blocks(c) if b.excerpt_of)
    for failure in failures:
        print(failure)
    print(f"{len(chapters)} chapters, {excerpts} excerpts, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
