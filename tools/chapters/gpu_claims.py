"""Nothing in this project has run on a GPU, so no sentence may read as if it had.

The CUDA paths (Triton kernels, CUDA graphs, pinned copies, NCCL) are written, tested on a CPU in Triton's
interpreter and compiled ahead of time for sm_80/sm_90; their GPU speeds are arithmetic (bytes over bandwidth),
not measurements. A reader who sees "on an H100 the kernel takes 80 µs" believes somebody timed it. This rule
finds sentences that state GPU behaviour as fact:

    runs       a verb of running next to a GPU:     "replays CUDA graphs", "runs on the GPU",
                                                    "On CUDA, X launches two kernels", "the copies overlap on CUDA"
    numbers    a time, a rate or a speed-up with a  "on an H100 it takes 7.5 µs", "1.21 ms on 8 GPUs",
               GPU named in the same sentence       "the kernel reaches 2.9 TB/s on an H100"
    compares   faster, slower, better, pays ...     "is faster on a GPU", "on an H100, recompute is the better
               said of a GPU                        preemption"

and lets one pass only when it is framed, in the sentence, in its paragraph (a list item is its own paragraph)
or in the heading of its section: "never run", "not run", "has not run", "on paper", "would", "written for",
"compiled for", "interpreter", "bound" (an upper or lower bound; not "memory-bound" or "bound by"),
"expected", "untested", "unmeasured", "no GPU", "without a GPU". A banner (a blockquote that says "Never run on
a GPU") is framed by its own words. Only prose is read: code blocks, code spans and HTML comments are not.

A sentence that is not framed is reworded so that it says what is true ("written for the GPU and never run on
one", "at 3.35 TB/s the read alone takes 7.5 µs, a bound"), never exempted by loosening the patterns.
Failures are `file:line: why: "the sentence"`.
"""

from __future__ import annotations

import re

from tools.chapters.doc import Document

GPU = r"(?:GPUs?|CUDA(?:\s+graphs?)?|H100s?|A100s?|H200s?|NVIDIA|sm_\d\d|NCCL|NVLink)"
NUMBER = r"(?<![\w.])\d[\d,]*(?:\.\d+)?"
TIME_OR_RATE = (  # 7.5 µs, 1.21 ms, 2 s, 900 tok/s, 2.9 TB/s, 3.3x (a ratio, not the `48 × 128` of arithmetic)
    rf"{NUMBER}\s?(?:µs|us|ms|s|seconds?|tok(?:en)?s?/s|req(?:uest)?s?/s|[GT]B/s|[GT]FLOP/s)\b|{NUMBER}[×x](?![\w×])"
)
RUN_VERB = (  # "a kernel launch" is a noun, so launch is inflected only
    r"(?:runs?|ran|executes?|executed|launches|launched|replays?|replayed|captures?|captured|overlaps?|overlapped|"
    r"saturates?|saturated|reach(?:es|ed)?|achieves?|achieved|sustains?|sustained|hides?|asynchronous(?:ly)?)"
)
COMPARE = r"(?:faster|slower|speeds?\s+up|sped\s+up|better|worse|pays|wins|beats|outperforms)"
NEAR = r"[^.;:()]{0,40}?"  # the same clause: no sentence end, no parenthesis between
CLAIMS = [
    (re.compile(rf"\b{RUN_VERB}\b{NEAR}\b(?:on|in|with|through)\s+(?:an?\s+|the\s+|\w+\s+)?{GPU}\b", re.I), "runs"),
    (re.compile(rf"\b(?:on|with)\s+(?:an?\s+|the\s+)?{GPU}\b[^.;()]{{0,80}}?\b{RUN_VERB}\b", re.I), "runs"),
    (re.compile(rf"\b{RUN_VERB}\s+(?:its\s+|the\s+|a\s+)?{GPU}\b", re.I), "runs"),
    (
        re.compile(rf"(?:{TIME_OR_RATE})[^.;()]{{0,60}}?\b{GPU}\b|\b{GPU}\b[^.;()]{{0,60}}?(?:{TIME_OR_RATE})"),
        "numbers",
    ),
    (re.compile(rf"\b{COMPARE}\b[^.;()]{{0,60}}?\b{GPU}\b|\b{GPU}\b[^.;()]{{0,60}}?\b{COMPARE}\b", re.I), "compares"),
]
FRAMED = re.compile(
    r"\bnever\s+(?:been\s+)?r[au]n\b|\bnot\s+(?:been\s+|yet\s+)?r[au]n\b|\bhas\s+not\s+run\b|\bon[\s-]paper\b|"
    r"\bwould\b|\bwritten\s+for\b|\bcompiled\s+for\b|\binterpreter\b|(?<![-\w])bounds?\b(?!\s+by\b)|\bexpected\b|"
    r"\buntested\b|\bunmeasured\b|\bno\s+GPU\b|\bwithout\s+a\s+GPU\b",
    re.IGNORECASE,
)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(*\[`\"])")
NOT_PROSE = re.compile(r"<!--.*?(?:-->|$)|`[^`]*`")


def sentences(paragraph: str) -> list[str]:
    """The sentences of a paragraph of prose, code spans and comments emptied, abbreviations kept whole."""
    text = re.sub(r"\s*\(``\)", "", NOT_PROSE.sub("``", paragraph))  # "(`pin_memory=True`)" is not a clause
    text = re.sub(r"\b(e\.g|i\.e|vs|cf|etc)\.", lambda m: m.group(1).replace(".", "\0") + "\0", text)
    text = re.sub(r"\s+", " ", text)  # a list item's continuation lines are indented
    return [s.replace("\0", ".").strip() for s in SENTENCE_END.split(text) if s.strip()]


def gpu_claim(sentence: str) -> str | None:
    """Which kind of GPU claim a sentence makes (`runs`, `numbers`, `compares`), or None."""
    return next((why for pattern, why in CLAIMS if pattern.search(sentence)), None)


def framed(text: str) -> bool:
    return bool(FRAMED.search(NOT_PROSE.sub("``", text)))


def heading_of(doc: Document, line: int) -> str:
    """The nearest heading (any level) above a line."""
    return next((t for n, t in reversed(doc.prose) if n < line and t.startswith("#")), "")


def check_gpu_claims(doc: Document) -> list[str]:
    failures: list[str] = []
    seen: set[str] = set()
    for line, text in doc.prose:
        if not text.strip() or text.startswith("#"):
            continue
        paragraph = doc.paragraph(line)
        if paragraph in seen:
            continue
        seen.add(paragraph)
        if framed(paragraph) or framed(heading_of(doc, line)):
            continue
        for sentence in sentences(paragraph):
            if why := gpu_claim(sentence):
                failures.append(
                    f"{doc.name}:{line}: a GPU result stated as fact ({why}); nothing here has run on a GPU: "
                    f"say so, or that it is written for one or a bound: {sentence!r}"
                )
    return failures
