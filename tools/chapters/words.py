"""The words of the chapters and of README.md: what the code does and what was measured, nothing else.

    goal-talk     a target, a goal, an aim, a budget to stay under, what was set out   -> say what was measured
    placeholders  TODO, TBD, FIXME, XXX, "placeholder", "to be written"               -> write it
    local paths   /work/..., /home/... anywhere; /tmp/... in captured output          -> a relative path
    output marks  `<!-- output: CMD -->` names a command the chapter shows above it
    the Layout    README.md's Layout block lists every module of roseinfer/, one line each

Only prose is read for goal-talk (code spans, code blocks and HTML comments are not prose), and each pattern
names the sense it catches, so the same word in another sense passes: the scheduler's "token budget", a
"memory budget", speculative decoding's "target model", "the target of" a copy.
"""

from __future__ import annotations

import ast
import re

from tools.chapters.doc import OUTPUT_MARK, REPO, SHELL, Document, git

GOAL_TALK = [
    (r"\bgoals?\b", "a goal"),
    (r"\baim(?:s|ed|ing)?\b", "an aim"),
    (r"\bset (?:out|ourselves) to\b", "what was set out"),
    (r"\b(?:speed|performance|latency|throughput|accuracy|memory|quality) targets?\b", "a target"),
    (r"\btargets?\s+(?:of|is|was|were|are|:)\s*[~≈<>≥≤]?\s*\d", "a target"),
    (r"\btargets?\s+(?:is|was|were|are)\s+(?:met|missed|reached|hit|not)\b", "a target"),
    (
        r"\b(?:meets?|met|miss(?:es|ed)?|hits?|reach(?:es|ed)?|beats?|exceed(?:s|ed)?|short of|below|above|on)"
        r"\s+(?:the\s+|its\s+|this\s+|our\s+|a\s+)?targets?\b",
        "a target",
    ),  # fmt: skip
    (r"\bbudgets?\s+(?:of|is|was)\s+[~≈<]?\s*\d+(?:\.\d+)?\s*(?:%|×|x\b|percent)", "a budget to stay under"),
    (r"\d\s*(?:%|×|percent)\s+budget", "a budget to stay under"),
    (r"\b(?:within|over|inside)\s+(?:the\s+|its\s+|our\s+)?budget\b", "a budget to stay under"),
    (r"\b(?:time|overhead|performance|speed|cost|error) budget\b", "a budget to stay under"),
    (r"(?-i:\b(?:TODO|TBD|FIXME|XXX)\b)", "a placeholder"),
    (r"\bplaceholders?\b", "a placeholder"),
    (r"\b(?:to be written|coming soon|lorem ipsum|fill (?:this|it) in later)\b", "a placeholder"),
]
GOAL_TALK_RE = [(re.compile(p, re.IGNORECASE), why) for p, why in GOAL_TALK]
# A path only one machine has: a home or work folder anywhere, a temporary folder in captured output.
LOCAL_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|Users|root|mnt)/[\w.-]")
TEMP_PATH = re.compile(r"(?<![\w.~-])/(?:tmp|var/folders)/[\w.-]")


def goal_talk(text: str) -> list[tuple[str, str]]:
    """(why, words) for every goal-talk pattern a line of prose matches; code spans and comments do not count."""
    prose = re.sub(r"<!--.*?(-->|$)", "", re.sub(r"`[^`]*`", "``", text))
    return [(why, m.group(0)) for pattern, why in GOAL_TALK_RE if (m := pattern.search(prose))]


def check_words(doc: Document) -> list[str]:
    failures: list[str] = []
    for line, text in doc.prose:
        for why, words in goal_talk(text):
            failures.append(f"{doc.name}:{line}: {why}; state what the code does or what was measured: {words!r}")
    outputs = [b for b in doc.blocks if b.lang in {"", "text", "console"} and not b.excerpt_of]
    for line, text in doc.lines():
        if m := LOCAL_PATH.search(text):
            failures.append(f"{doc.name}:{line}: a path of one machine (use a relative path): {m.group(0)}...")
    for line, text in [(b.start + i, t) for b in outputs for i, t in enumerate(b.lines)]:
        if m := TEMP_PATH.search(text):
            failures.append(f"{doc.name}:{line}: a temporary path in captured output: {m.group(0)}...")
    return failures


def shown_commands(doc: Document, fence: int) -> set[str]:
    """The commands a reader sees above the block that opens at `fence`: the lines of the last shell block before
    it (comments cut), its own `$ ` lines, and the code spans of the paragraph above its output mark."""
    shells = [b for b in doc.blocks if b.lang in SHELL and b.start < fence]
    shown = {re.sub(r"\s+#.*$", "", t).strip() for t in shells[-1].lines} if shells else set()
    here = next((b for b in doc.blocks if b.start == fence + 1), None)
    if here is not None:
        shown |= {t[2:].strip() for t in here.lines if t.startswith("$ ")}
    above = max((n for n, t in doc.prose if n < fence and t.strip() and not OUTPUT_MARK.match(t)), default=0)
    return shown | set(re.findall(r"`([^`]+)`", doc.paragraph(above)))


def check_marks(doc: Document) -> list[str]:
    """Every output mark sits just before a fenced block and names a command the chapter shows above it."""
    failures: list[str] = []
    marked = {b.start - 1: b for b in doc.blocks if b.mark is not None}
    for line, text in doc.prose:
        if "<!--" in text and "output" in text and line + 1 not in marked and line + 2 not in marked:
            failures.append(f"{doc.name}:{line}: an output mark is the last line before a fenced block")
    for fence, block in marked.items():
        if block.mark not in shown_commands(doc, fence):
            failures.append(f"{doc.name}:{fence}: the marked command is not shown above the output: {block.mark}")
    return failures


def check_layout(doc: Document) -> list[str]:
    """README.md's Layout block names every module of roseinfer/ (a package's __init__.py only if it has code
    besides its docstring), and only modules that exist."""
    block = next((b for b in doc.blocks if doc.section(b.start) == "Layout" and b.lines[:1] == ["roseinfer/"]), None)
    if block is None:
        return [f"{doc.name}: no Layout block that starts with `roseinfer/`"]
    listed: dict[str, int] = {}
    stack: list[tuple[int, str]] = []
    for number, line in enumerate(block.lines, start=block.start):
        if not re.match(r"\s*[\w.-]+(/[\w.-]+)*/?(\s|$)", line):
            continue
        indent, word = len(line) - len(line.lstrip(" ")), line.split()[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([s for _, s in stack] + [word.rstrip("/")])
        if word.endswith("/"):
            stack.append((indent, word.rstrip("/")))
        elif path.endswith(".py"):
            listed[path] = number

    def has_code(path: str) -> bool:
        body = ast.parse((REPO / path).read_text(encoding="utf-8")).body
        return not path.endswith("__init__.py") or len(body) > (1 if body and isinstance(body[0], ast.Expr) else 0)

    modules = {p for p in git("ls-files", "roseinfer").split() if p.endswith(".py") and has_code(p)}
    failures = [f"{doc.name}:{block.start}: the Layout block does not list {m}" for m in sorted(modules - set(listed))]
    failures += [
        f"{doc.name}:{n}: the Layout block lists {p}, not a module" for p, n in listed.items() if p not in modules
    ]
    return failures
