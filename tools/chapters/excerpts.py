"""Excerpts: a code block that names a file is a contiguous run of that file at the chapter's stage.

    ```python                          the file at the stage
    # roseinfer/scheduler.py           ...
        def add_request(...):    ───►   31    def add_request(...):
            ...body...                  32        ...body...
                                        36
        ...                      ───►   37-39  (one or more lines left out)
                                        40
        def step(self):          ───►   41    def step(self):
    ```

The block's lines are split into parts at its `...` lines; each part must equal a run of consecutive
lines of the file (blank lines included), the parts in the file's order, with at least one line left out
between two parts. Lines compare without trailing blanks; the whole block may sit left of the file by one
constant indentation. A ```diff block is two such excerpts: its ` `/`+` lines of the stage's file, its
` `/`-` lines of the previous stage's, `@@` lines being gaps on both sides.
"""

from __future__ import annotations

from tools.chapters.doc import ELISION, Document, Snapshots

Lines = list[tuple[int, str]]  # (chapter line, text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def parts(lines: Lines) -> list[Lines]:
    """Split at the `...` lines; blank lines at a part's edges are dropped."""
    out: list[Lines] = [[]]
    for number, text in lines:
        if text.strip() == ELISION:
            out.append([])
        else:
            out[-1].append((number, text.rstrip()))
    for part in out:
        while part and not part[0][1]:
            part.pop(0)
        while part and not part[-1][1]:
            part.pop()
    return [p for p in out if p]


def _run_length(part: Lines, file: list[str], at: int, shift: int) -> int:
    """How many of the part's lines equal the file's from index `at` on, the part indented by `shift` more."""
    n = 0
    while n < len(part) and at + n < len(file):
        want, have = part[n][1], file[at + n].rstrip()
        if not (have == " " * shift + want if want else not have):
            break
        n += 1
    return n


def _place(part: Lines, file: list[str], at: int, shift: int) -> int | None:
    """The first index from `at` on where the whole part matches."""
    return next((i for i in range(at, len(file)) if _run_length(part, file, i, shift) == len(part)), None)


def match_excerpt(lines: Lines, file: list[str]) -> str | None:
    """None if the parts are runs of the file in order; else `LINE: why` for the line that breaks the match."""
    split = parts(lines)
    if not split:
        return None
    first = split[0][0][1]
    shifts = sorted({_indent(f) - _indent(first) for f in file if f.strip() == first.strip()})
    best = (-1, f"{split[0][0][0]}: not in the file: {first.strip()}")
    for shift in (s for s in shifts if s >= 0):
        at, failed = 0, False
        for k, part in enumerate(split):
            found = _place(part, file, at, shift)
            if found is not None:
                at = found + len(part) + 1  # the next part comes after a gap of at least one line
                continue
            failed = True
            n, i = max(((_run_length(part, file, i, shift), i) for i in range(at, len(file))), default=(0, 0))
            number, text = part[min(n, len(part) - 1)]
            if _place(part, file, 0, shift) is not None:
                why = f"{part[0][0]}: out of order, or a gap without a `...` line before it: {part[0][1].strip()}"
            elif n == 0:
                why = f"{number}: not in the file at this place: {text.strip()}"
            else:
                follows = file[i + n].strip() if i + n < len(file) else "the end of the file"
                why = f"{number}: the file has `{follows}` here, not `{text.strip()}` (copy it, or gap it with `...`)"
            progress = sum(len(p) for p in split[:k]) + n
            if progress > best[0]:
                best = (progress, why)
            break
        if not failed:
            return None
    return best[1]


def diff_side(body: Lines, sign: str) -> Lines:
    """One side of a diff excerpt: context lines and the lines starting with `sign`; `@@` lines are gaps."""
    side: Lines = []
    for number, text in body:
        if text.startswith("@@") or text.strip() == ELISION:
            side.append((number, ELISION))
        elif not text.strip():
            side.append((number, ""))
        elif text[0] in " " + sign:
            side.append((number, text[1:]))
    return side


def check_excerpts(doc: Document, stage: str, commit: str | None, previous: str | None, files: Snapshots) -> list[str]:
    where = f"stage {stage} ({commit[:10] if commit else 'the working tree'})"
    failures: list[str] = []
    for block in doc.blocks:
        path = block.excerpt_of
        if path is None:
            continue
        body = list(enumerate(block.lines[1:], start=block.start + 1))
        sides = [(commit, body, where)]
        if block.lang == "diff":
            bad = [n for n, t in body if t.strip() and t[:1] not in " +-@" and t.strip() != ELISION]
            failures += [f"{doc.name}:{n}: {path}: a diff line starts with ' ', '+', '-' or '@@'" for n in bad]
            sides = [(commit, diff_side(body, "+"), where)]
            if any(t[:1] == "-" for _, t in body):
                if previous is None:
                    failures.append(f"{doc.name}:{block.start}: {path}: removed lines, but no stage before {stage}")
                else:
                    sides.append((previous, diff_side(body, "-"), f"the previous stage ({previous[:10]})"))
        for at, lines, label in sides:
            file = files.text(at, path)
            if file is None:
                failures.append(f"{doc.name}:{block.start}: {path} does not exist at {label}")
            elif why := match_excerpt(lines, file):
                failures.append(f"{doc.name}:{why} [{path} at {label}]")
    return failures
