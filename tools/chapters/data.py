"""Every measured number in a chapter names the command that made it and the data file that holds it.

    Data: `results/05-batched-decode/small.json` (median of 3 runs).      a line of prose
    ```                                                                    the block right after it,
    # AMD EPYC (torch threads: 2) | ...                                    if there is one, is that
    ```                                                                    file's output

Rules, each failure printed as `file:line: why`:

1. A `Data:` line names files under results/ in backquotes (a `*` is a glob), or a bundled model's
   training_report.json (which tools/models/train_tiny_model.py writes next to the weights); each matches a file in
   this checkout.
2. A file with a `command` (a record that tools/chapters/reproduce.py wrote) comes from a `[[run]]` of its stage's
   results/NN-slug/runs.toml with that same command, and the chapter shows the command (in a shell block, an
   output mark or backquotes), so a reader can run it.
3. A block right after a `Data:` line (only blank lines between) is the record's output: its `median` over the
   runs (or its one run), line for line, runs of blanks as one blank. A first line `$ COMMAND` is not output;
   a `...` line skips output lines as in an excerpt. `check_chapters.py --sync-data` rewrites such blocks
   (those without `...`) from their records.
4. A section (`## `) that has a measured number (a rate such as `726 tokens/s`, a time such as `14.09 s` or
   `7.6 ms`, a ratio such as `1.62×`) in its prose or in an output block, outside code spans, has a `Data:`
   line. Numbers another source measured are cited instead, in a paragraph that names the source by a
   link; a section without measurements of its own that quotes another chapter's links to it.
"""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path

import tomllib

from tools.chapters.doc import ELISION, REPO, SHELL, Block, Document
from tools.chapters.outputs import match_output

DATA_LINE = re.compile(r"^\s*(?:[-*]\s+)?\**Data\**:")
DATA_PATH = re.compile(r"`(results/[^`\s]+|roseinfer/models/[\w.-]+/training_report\.json)`")
CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"\]\([^)]+\)|https?://")
NUM = r"(?<![\w.])\d[\d,]*(?:\.\d+)?"
MEASURED = re.compile(  # a rate, a time (`14 s`, `1.15s`, not `the 400s`), a ratio (`1.62×`, `2x`, not `3 × 4`)
    rf"{NUM}\s?(?:tok(?:en)?s?/s|req(?:uest)?s?/s|ms|µs)\b|{NUM}\ss\b|(?<![\w.])\d[\d,]*\.\d+s\b|{NUM}[×x](?![\w×])"
)


def records(pattern: str) -> list[Path]:
    return sorted(Path(p) for p in glob.glob(str(REPO / pattern)))


def recorded_output(record: dict) -> str:
    return record["median"] if record.get("median") is not None else record["runs"][0]["output"]


def shown_lines(text: str) -> list[str]:
    lines = [re.sub(r"\s+", " ", line).strip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def block_after(doc: Document, line: int) -> Block | None:
    """The block whose fence follows `line` with only blank lines (or an output mark) between."""
    prose = dict(doc.prose)
    for block in doc.blocks:
        if block.start - 1 > line:
            between = [prose.get(n, "") for n in range(line + 1, block.start - 1)]
            if all(not t.strip() or t.strip().startswith("<!--") for t in between):
                return block
            return None
    return None


def runs_commands(stage: str) -> set[str]:
    path = REPO / "results" / stage / "runs.toml"
    if not path.is_file():
        return set()
    return {r["command"] for r in tomllib.loads(path.read_text(encoding="utf-8")).get("run", [])}


def shows_command(doc: Document, command: str) -> bool:
    """The command (any `{run}` loop variable aside) is in a shell block, an output mark or backquotes."""
    want = re.sub(r"\s+", " ", re.sub(r"\\\n", " ", command.replace("{repo}/", ""))).strip()
    text = [b.mark or "" for b in doc.blocks] + ["\n".join(b.lines) for b in doc.blocks if b.lang in SHELL]
    text += [t for _, t in doc.prose]
    flat = re.sub(r"\s+", " ", re.sub(r"\\\n", " ", "\n".join(text)))
    if "{run}" in want:
        return all(part.strip() in flat for part in want.split("{run}") if part.strip())
    return want in flat


def compare(block: Block, output: str) -> str | None:
    shown = list(block.lines)
    while shown and shown[0].startswith("$ ") and not output.startswith(shown[0]):  # the command, unless printed
        shown.pop(0)
    return match_output(shown_lines("\n".join(shown)), shown_lines(output), block.start)


def data_lines(doc: Document) -> list[tuple[int, list[str]]]:
    """(the last line of each Data: paragraph, the paths it names)."""
    text = dict(doc.prose)
    found = []
    for n, t in doc.prose:
        if DATA_LINE.match(t):
            last = n
            while text.get(last + 1, "").strip() and not text[last + 1].strip().startswith("<!--"):
                last += 1
            found.append((last, DATA_PATH.findall(" ".join(text[k] for k in range(n, last + 1)))))
    return found


def check_data(doc: Document) -> list[str]:
    failures = []
    where = doc.name
    for line, paths in data_lines(doc):
        if not paths:
            failures.append(f"{where}:{line}: a Data: line names no `results/...` file")
        for pattern in paths:
            found = records(pattern)
            if not found:
                failures.append(f"{where}:{line}: {pattern}: no such data file")
                continue
            block = block_after(doc, line)
            for path in found:
                record = json.loads(path.read_text(encoding="utf-8")) if path.suffix == ".json" else {}
                if not isinstance(record, dict) or "command" not in record or "runs" not in record:
                    continue
                command = record["command"]
                if command not in runs_commands(record.get("stage", "")):
                    failures.append(f"{where}:{line}: {pattern}: `{command}` is not a run of its stage's runs.toml")
                if not shows_command(doc, command):
                    failures.append(f"{where}:{line}: {pattern}: the chapter does not show `{command}`")
                shown = block is not None and len(found) == 1 and block.lang not in SHELL
                if shown and (why := compare(block, recorded_output(record))):
                    failures.append(f"{where}:{block.start - 1}: the block is not {pattern}'s output: {why}")
    failures += unsourced(doc)
    return failures


def measured(text: str) -> str | None:
    m = MEASURED.search(CODE_SPAN.sub("", text))
    return m.group(0) if m else None


def unsourced(doc: Document) -> list[str]:
    """Rule 4: the first measured number of each section that has no Data: line."""
    sections: dict[str, list[tuple[int, str]]] = {}
    for n, t in doc.prose:
        if t.startswith("#") or DATA_LINE.match(t):
            continue
        if (number := measured(t)) and not LINK.search(doc.paragraph(n)):
            sections.setdefault(doc.section(n), []).append((n, number))
    for block in doc.blocks:
        if block.lang in SHELL or block.excerpt_of or block.lang in {"python", "diff", "toml", "json", "cpp", "c"}:
            continue
        for i, t in enumerate(block.lines):
            if number := measured(t):
                sections.setdefault(doc.section(block.start), []).append((block.start + i, number))
                break
    with_data = {doc.section(n) for n, _ in data_lines(doc)}
    return [
        f"{doc.name}:{hits[0][0]}: `{hits[0][1]}` is measured, and section '{section}' names no Data: file"
        for section, hits in sections.items()
        if section not in with_data and section != "Run this chapter"
    ]


def sync(doc: Document) -> int:
    """Rewrite each block right after a one-file Data: line (and without `...`) from its record; how many changed."""
    text = doc.path.read_text(encoding="utf-8").split("\n")
    changed = 0
    for line, paths in reversed(data_lines(doc)):
        block = block_after(doc, line)
        found = records(paths[0]) if len(paths) == 1 else []
        if block is None or block.lang in SHELL or len(found) != 1 or ELISION in [b.strip() for b in block.lines]:
            continue
        record = json.loads(found[0].read_text(encoding="utf-8"))
        if "runs" not in record:
            continue
        output = recorded_output(record)
        first = block.lines[0] if block.lines else ""
        head = [first] if first.startswith("$ ") and not output.startswith(first) else []
        indent = re.match(r"\s*", text[block.start - 2]).group(0)
        new = head + output.rstrip("\n").split("\n")
        old = text[block.start - 1 : block.start - 1 + len(block.lines)]
        new = [indent + x if x else x for x in new]
        if new != old:
            text[block.start - 1 : block.start - 1 + len(block.lines)] = new
            changed += 1
    if changed:
        doc.path.write_text("\n".join(text), encoding="utf-8")
    return changed
