"""Every chapter links the chapters on either side of it and shows the diff that is its lesson.

    Previous   chapter NN (NN > 01) links chapter NN-1's README on a line that says "Previous"
    Next       a chapter whose next chapter exists links it on a line that says "Next"
    diff       a shell block shows `git diff [options] stage-<NN-1> stage-<NN> ...` (the stages' tag names), so a
               reader can see what the stage changed

Each failure is `chapter:line: why` (line 1 when something is missing).
"""

from __future__ import annotations

import re

from tools.chapters.doc import REPO, SHELL, Document


def neighbours(stage: str) -> tuple[str | None, str | None]:
    """The stages (NN-slug) just before and after `stage`, from the chapters/ folders."""
    stages = sorted(p.parent.name for p in REPO.glob("chapters/[0-9][0-9]-*/README.md"))
    if stage not in stages:
        return None, None
    i = stages.index(stage)
    return (stages[i - 1] if i > 0 else None), (stages[i + 1] if i + 1 < len(stages) else None)


def check_links(doc: Document, stage: str, around: tuple[str | None, str | None] | None = None) -> list[str]:
    """The rules above for a chapter of chapters/ (`around`: its neighbours, found from the folders if None; a
    document elsewhere, such as a test's, is not a chapter of the book and is not checked unless given them)."""
    if around is None and doc.path.resolve() != (REPO / "chapters" / stage / "README.md").resolve():
        return []
    prev, nxt = around if around is not None else neighbours(stage)
    failures = []
    for word, other in (("Previous", prev), ("Next", nxt)):
        if other is None:
            continue
        link = f"](../{other}/README.md)"
        if not any(word in text and link in text for _, text in doc.prose):
            failures.append(f"{doc.name}:1: no '{word}: [...]({link[2:-1]})' link")
    if prev is not None:
        diff = re.compile(rf"\bgit diff\b.*\bstage-{re.escape(prev)}\b.*\bstage-{re.escape(stage)}\b")
        if not any(diff.search(t) for b in doc.blocks if b.lang in SHELL for t in b.lines):
            failures.append(f"{doc.name}:1: no shell block with `git diff stage-{prev} stage-{stage}`")
    return failures
