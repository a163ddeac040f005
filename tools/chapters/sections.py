"""Every chapter walks the reader down the same path, so a reader who knows one chapter can find their way in any.

    ## Run this chapter                     unnumbered, the first `## ` section: check the stage out, run it
    ## 1. The problem                       what the previous stage cannot do
    ## 2. The idea                          the idea, drawn
    ## 3. Walkthrough of the code           the real diff, hunk by hunk (or "Walkthrough of the diff")
    ## 4. ...                               more about the code, if the chapter needs it (any title; only here)
    ## N. Run it                            real captured output
    ## N. Check yourself                    which tests prove it
    ## N. Exercises
    ## N. Build it yourself                 the stubs of exercises/NN-slug.toml
    ## N. What the next stage fixes         optional ("What is not done yet", "What is still missing, ...",
                                            "Where to go next")
    ## N. Measured                          last: the numbers, each with its command and Data: file
                                            ("Measured: naive vs KV cache": a subtitle after a colon)

Rules, each failure printed as `chapter:line: why`:

1. The first `## ` section is "Run this chapter", and every other `## ` section is numbered `N. Title`.
2. The numbers run 1, 2, ..., N without gaps or repeats.
3. The named sections each appear once (all but the optional "what comes next" one are required) and in the
   order above. A section with another title is more about the code: it goes after the walkthrough and
   before "Run it". Measured closes the chapter, so a reader reaches the numbers after knowing how the code
   works, how to run it and how to check it, and a chapter's numbers are found in one place.
4. A subsection numbered `### N.M` sits in section N, and its M run 1, 2, ... within that section (so a
   section that moves takes its subsections' numbers with it).

A section found out of order is the one that breaks the longest run of sections in order, so "Measured" in the
middle of a chapter is reported as Measured, not as every section after it.
"""

from __future__ import annotations

import re

from tools.chapters.doc import REPO, Document

BOX = "Run this chapter"
NUMBERED = re.compile(r"^(\d+)\.\s+(.+?)\s*$")
SUBSECTION = re.compile(r"^###\s+(\d+)\.(\d+)\b")
EXTRA = "more about the code"
# (name in messages, title pattern), in the order a chapter has them; EXTRA sits between the walkthrough and Run it
KINDS = [
    ("The problem", r"The problem"),
    ("The idea", r"The idea"),
    ("Walkthrough of the code", r"Walkthrough of the (?:code|diff)"),
    (EXTRA, None),
    ("Run it", r"Run it"),
    ("Check yourself", r"Check yourself"),
    ("Exercises", r"Exercises"),
    ("Build it yourself", r"Build it yourself"),
    (
        "What the next stage fixes",
        r"What the next stage fixes|What is not done yet|What is still missing, and what comes next|Where to go next",
    ),
    ("Measured", r"Measured(?::\s+\S.*)?"),
]
EXTRA_KIND = [name for name, _ in KINDS].index(EXTRA)
OPTIONAL = {EXTRA, "What the next stage fixes"}
ORDER = (  # [...]: optional
    f"the order is {BOX}, 1. The problem, The idea, Walkthrough of the code, [other sections on the code], Run it, "
    "Check yourself, Exercises, Build it yourself, [What the next stage fixes], Measured"
)


def kind_of(title: str) -> int:
    """The index in KINDS of a numbered section's title (without its number); EXTRA's for any other title."""
    for i, (_, pattern) in enumerate(KINDS):
        if pattern is not None and re.fullmatch(pattern, title):
            return i
    return EXTRA_KIND


def in_order(ranks: list[int], weights: list[int]) -> set[int]:
    """The positions of the heaviest run of `ranks` that never goes down: the sections left where they are (a named
    section weighs more than one about the code, so it is the other title that is reported)."""
    best = list(weights)
    before = [-1] * len(ranks)
    for i in range(len(ranks)):
        for j in range(i):
            if ranks[j] <= ranks[i] and best[j] + weights[i] > best[i]:
                best[i], before[i] = best[j] + weights[i], j
    keep, i = set(), max(range(len(ranks)), key=lambda k: best[k], default=-1)
    while i >= 0:
        keep.add(i)
        i = before[i]
    return keep


def check_sections(doc: Document, stage: str, in_book: bool | None = None) -> list[str]:
    """The rules above for a chapter of chapters/ (`in_book`: check it wherever it is; a document elsewhere, such
    as a test's, is not a chapter of the book and is not checked unless told to)."""
    if in_book is None:
        in_book = doc.path.resolve() == (REPO / "chapters" / stage / "README.md").resolve()
    if not in_book:
        return []
    where = doc.name
    headings = [(n, t[3:].strip()) for n, t in doc.prose if t.startswith("## ")]
    failures: list[str] = []
    if not headings or headings[0][1] != BOX:
        line = headings[0][0] if headings else 1
        failures.append(f"{where}:{line}: the first `## ` section is not '{BOX}'; {ORDER}")
    numbered: list[tuple[int, int, str, int]] = []  # (line, number, heading, kind)
    for line, heading in headings:
        if heading == BOX:
            if numbered:
                failures.append(f"{where}:{line}: '{BOX}' comes after numbered sections; it is the first")
            continue
        m = NUMBERED.match(heading)
        if m is None:
            failures.append(f"{where}:{line}: section '{heading}' has no number (`## N. Title`)")
            continue
        numbered.append((line, int(m.group(1)), heading, kind_of(m.group(2))))
    wrong = [(n, number, h, i) for i, (n, number, h, _) in enumerate(numbered, start=1) if number != i]
    if wrong:  # the first one only: a gap makes every number after it wrong too
        line, number, heading, expected = wrong[0]
        failures.append(
            f"{where}:{line}: section '{heading}' is numbered {number}, expected {expected} "
            "(sections are numbered 1, 2, ... without gaps or repeats)"
        )
    kinds = [kind for *_, kind in numbered]
    for i, (name, _) in enumerate(KINDS):
        count = kinds.count(i)
        if count == 0 and name not in OPTIONAL:
            failures.append(f"{where}:1: no '{name}' section; {ORDER}")
        if count > 1 and name != EXTRA:
            line = [n for n, _, _, k in numbered if k == i][1]
            failures.append(f"{where}:{line}: a second '{name}' section")
    keep = in_order(kinds, [1 if k == EXTRA_KIND else 2 for k in kinds])
    for i, (line, _, heading, kind) in enumerate(numbered):
        if i not in keep:
            what = "a section about the code" if kind == EXTRA_KIND else f"'{KINDS[kind][0]}'"
            failures.append(f"{where}:{line}: section '{heading}' ({what}) is out of order; {ORDER}")
    return failures + check_subsections(doc)


def check_subsections(doc: Document) -> list[str]:
    """Rule 4: `### N.M` under `## N.`, with M counting 1, 2, ... in each section."""
    failures: list[str] = []
    section, count = None, 0
    for line, text in doc.prose:
        if text.startswith("## "):
            m = NUMBERED.match(text[3:].strip())
            section, count = (int(m.group(1)) if m else None), 0
        elif m := SUBSECTION.match(text):
            count += 1
            want = f"{section}.{count}" if section is not None else "an unnumbered subsection"
            if section is None or (int(m.group(1)), int(m.group(2))) != (section, count):
                failures.append(f"{doc.name}:{line}: subsection '{text[4:].strip()}' should be numbered {want}")
                count = int(m.group(2))  # one wrong number is one failure, not one per subsection after it
    return failures
