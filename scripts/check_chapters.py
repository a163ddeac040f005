"""Check that a chapter says only what the code, tests and scripts of its stage bear out.

    python scripts/check_chapters.py                  # every chapters/NN-slug/README.md, and README.md's words
    python scripts/check_chapters.py chapters/03-offline-scheduler/README.md
    python scripts/check_chapters.py --outputs 01 03  # slow: rerun the marked outputs of chapters 01 and 03

A chapter is checked against its stage: the commit whose trailer is `Stage: NN-slug` for `chapters/NN-slug/`
(found in `git log` as scripts/tag_stages.sh does, so no tags are needed); a chapter whose stage has no commit
yet, against the working tree. Files are read with `git show`, so the default mode takes seconds.

| what          | the rule                                                                                   |
|---------------|--------------------------------------------------------------------------------------------|
| excerpts      | a fenced block whose FIRST line names a repo file (`# roseinfer/engine.py`) is copied from  |
|               | that file: its lines are a contiguous run of the file, in order; a line that is only `...`  |
|               | (any indentation) stands for one or more lines left out, and is the only way to leave lines |
|               | out between the first and the last line shown. Lines compare without trailing blanks; the   |
|               | block may sit left of the file by one constant indentation (a method shown without its      |
|               | class); a blank line is a blank line of the file.                                            |
| diffs         | in a ```diff excerpt, ` ` and `+` lines are the stage's file, ` ` and `-` lines the previous |
|               | stage's (the highest-numbered stage below with a commit), each side under the rule above;  |
|               | `@@ ... @@` and `...` lines are gaps on both sides.                                          |
| test names    | every `test_...`/`tests/test_....py` in backticks in the prose and every `tests/...::...` in |
|               | a command names a test module, class or function of tests/ at the stage (`name[id]`: the id |
|               | of a literal parametrisation); every word of a `-k` expression matches some test.           |
| commands      | every script a ```bash line runs (`./x.sh`, `bash x.sh`, `python scripts/x.py`,            |
|               | `python -m pkg.mod`) exists at the stage; lines before `cd ../roseinfer-NN` run in this     |
|               | checkout and are checked against the working tree; every `stage-NN-slug` named is a stage,   |
|               | and `git worktree add ../roseinfer-NN TAG` in the "Run this chapter" box is this chapter's. |
| outputs       | `<!-- output: COMMAND -->` on the line before a fenced block marks the block as what        |
|               | COMMAND prints, the same on every run (greedy or seeded); COMMAND is a line of the ```bash  |
|               | block above. `--outputs` reruns it at the stage (scripts/chapter_outputs.py).               |
| words         | the prose of the chapters and of README.md states what the code does and what was measured: |
|               | no goal-talk and no placeholders (the patterns in GOAL_TALK).                               |

Every failure is printed as `file:line: why`; the exit status is 1 if there is any.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^\s*(`{3,})\s*([\w+-]*)")
# `# roseinfer/engine.py`: one path-like word (a folder or a file extension) and nothing else
HEADER = re.compile(r"^#\s*((?:[\w.-]+/)*[\w.-]*\w\.\w+|(?:[\w.-]+/)+[\w.-]+)\s*$")
ELISION = "..."
OUTPUT_MARK = re.compile(r"^\s*<!--\s*output:\s*(.+?)\s*-->\s*$")
STAGE_NAME = re.compile(r"\bstage-(\d\d)-[a-z0-9-]*[a-z0-9]")
# `test_x`, `test_x[id]`, `tests/test_f.py`, `tests/test_f.py::test_x`, `TestC::test_x`, in backticks
TEST_SPAN = re.compile(r"`((?:tests/)?test_\w+(?:\.py)?(?:::\w+)*(?:\[[^\]`]*\])?|Test\w+(?:::\w+)*)`")
TEST_NODE = re.compile(r"\btests/(test_\w+\.py)((?:::\w+)*)(\[[^\]\s]*\])?")

# Goal-talk and placeholders, in prose (code spans and code blocks are not prose). Each pattern says what it
# means so that the words with another sense pass: the scheduler's token budget, a memory budget, speculative
# decoding's target model.
GOAL_TALK = [
    (r"\bgoals?\b", "a goal"),
    (r"\baim(?:s|ed|ing)?\b", "an aim"),
    (r"\bset (?:out|ourselves) to\b", "what was set out"),
    (r"\b(?:speed|performance|latency|throughput|accuracy|memory|quality) targets?\b", "a target"),
    (r"\btargets?\s+(?:of|is|was|were|are|:)\s*[~≈<>≥≤]?\s*\d", "a target"),
    (r"\btargets?\s+(?:is|was|were|are)\s+(?:met|missed|reached|hit|not)\b", "a target"),
    (r"\b(?:meets?|met|miss(?:es|ed)?|hits?|reach(?:es|ed)?|beats?|exceed(?:s|ed)?|short of|below|above|on)"
     r"\s+(?:the\s+|its\s+|this\s+|our\s+|a\s+)?targets?\b", "a target"),  # fmt: skip
    (r"\bbudgets?\s+(?:of|is|was)\s+[~≈<]?\s*\d+(?:\.\d+)?\s*(?:%|×|x\b|percent)", "a budget to stay under"),
    (r"\d\s*(?:%|×|percent)\s+budget", "a budget to stay under"),
    (r"\b(?:within|over|inside)\s+(?:the\s+|its\s+|our\s+)?budget\b", "a budget to stay under"),
    (r"\b(?:time|overhead|performance|speed|cost|error) budget\b", "a budget to stay under"),
    (r"\b(?:TODO|TBD|FIXME|XXX)\b", "a placeholder"),
    (r"\bplaceholders?\b", "a placeholder"),
    (r"\b(?:to be written|coming soon|lorem ipsum|fill (?:this|it) in later)\b", "a placeholder"),
]
GOAL_TALK_RE = [(re.compile(p, re.IGNORECASE if "TODO" not in p else 0), why) for p, why in GOAL_TALK]


@dataclass
class Block:
    chapter: Path
    start: int  # 1-based line number, in the chapter, of the block's first content line
    lang: str
    lines: list[str]
    mark: str | None = None  # the command of an `<!-- output: COMMAND -->` line just before the fence


@dataclass
class Document:
    path: Path
    blocks: list[Block] = field(default_factory=list)
    prose: list[tuple[int, str]] = field(default_factory=list)  # (line number, text) outside code blocks


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
    """Repo files at a commit (None = the working tree), read once each."""

    def __init__(self) -> None:
        self._text: dict[tuple[str | None, str], list[str] | None] = {}
        self._tests: dict[str | None, set[str]] = {}

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
        proc = subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=REPO, capture_output=True)
        return proc.returncode == 0

    def listing(self, commit: str | None, folder: str) -> list[str]:
        """The file names in a folder at a commit."""
        if commit is None:
            return sorted(p.name for p in (REPO / folder).glob("*"))
        return sorted(Path(p).name for p in git("ls-tree", "--name-only", commit, f"{folder}/").split())

    def tests(self, commit: str | None) -> set[str]:
        """Every name a test goes by at a commit: `test_f.py`, `test_f`, `test_x`, `test_x[id]`, `TestC`, and
        `test_x[*]` for a test whose parametrisation is not literal (any id)."""
        if commit not in self._tests:
            names: set[str] = set()
            for name in self.listing(commit, "tests"):
                if name.startswith("test_") and name.endswith(".py"):
                    tree = ast.parse("\n".join(self.text(commit, f"tests/{name}") or []))
                    names |= {name, name[:-3]} | test_names(tree, lambda folder: self.listing(commit, folder))
            self._tests[commit] = names
        return self._tests[commit]


def test_names(tree: ast.Module, listing) -> set[str]:
    """Test functions, Test classes (also `TestX = Machine.TestCase`) and their methods of a module, and
    `name[id]` for the ids pytest gives their parametrisations."""
    names: set[str] = set()
    assigned = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    names |= {n for n in assigned if n.startswith("Test")}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                names.add(node.name)
                visit(node.body)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                names.add(node.name)
                ids = parametrize_ids(node, assigned, listing)
                names.update(f"{node.name}[{i}]" for i in (ids if ids is not None else ["*"]))

    visit(tree.body)
    return names


def parametrize_ids(node, assigned: dict[str, ast.expr], listing) -> list[str] | None:
    """The ids pytest gives a test's `@pytest.mark.parametrize` cases: [] if it has none, None if they are not
    literal. Stacked decorators give `inner-outer` ids, the decorator next to the function first."""
    ids: list[str] = []
    for dec in reversed(node.decorator_list):
        if not (isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "parametrize" and len(dec.args) >= 2):
            continue
        explicit = next((k.value for k in dec.keywords if k.arg == "ids"), None)
        these = _values(explicit, assigned, listing) if explicit is not None else None
        if these is None:
            cases = _values(dec.args[1], assigned, listing)
            if cases is None or explicit is not None:
                return None
            these = ["-".join(map(_id, c)) if isinstance(c, tuple) else _id(c) for c in cases]
        ids = [f"{a}-{b}" for a in ids for b in these] if ids else [str(t) for t in these]
    return ids


def _id(value) -> str:
    return str(value) if isinstance(value, str | int | float | bool | type(None)) else "?"


def _values(expr: ast.expr, assigned: dict[str, ast.expr], listing) -> list | None:
    """A literal, `range(...)`, or the files a module-level `... / "folder").glob("*.ext")` finds, named by
    `[p.name for p in FILES]`; None for anything else."""
    try:
        return list(ast.literal_eval(expr))
    except ValueError:
        pass
    if isinstance(expr, ast.Call) and getattr(expr.func, "id", "") == "range":
        try:
            return list(range(*[ast.literal_eval(a) for a in expr.args]))
        except ValueError:
            return None
    if isinstance(expr, ast.ListComp) and isinstance(expr.elt, ast.Attribute) and expr.elt.attr in {"name", "stem"}:
        source = expr.generators[0].iter
        files = assigned.get(source.id) if isinstance(source, ast.Name) else None
        calls = [c for c in ast.walk(files) if isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "glob"] if files else []
        strings = [c.value for c in ast.walk(files) if isinstance(c, ast.Constant) and isinstance(c.value, str)] if files else []
        if len(calls) == 1 and len(strings) == 2 and calls[0].args and isinstance(calls[0].args[0], ast.Constant):
            pattern = calls[0].args[0].value
            folder = next(s for s in strings if s != pattern)
            found = [f for f in listing(folder) if Path(f).match(pattern)]
            return found if expr.elt.attr == "name" else [Path(f).stem for f in found]
    return None


def read_document(path: Path) -> Document:
    doc = Document(path)
    current: Block | None = None
    fence = ""
    indent = 0  # a fence indented inside a list item: its lines carry that indentation too
    last_prose = ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        m = FENCE.match(line)
        if current is None:
            if m:
                mark = OUTPUT_MARK.match(last_prose)
                fence = m.group(1)
                current = Block(path, number + 1, m.group(2).lower(), [], mark.group(1) if mark else None)
                indent = len(line) - len(line.lstrip(" "))
            else:
                doc.prose.append((number, line))
                last_prose = line if line.strip() else last_prose if OUTPUT_MARK.match(last_prose) else ""
        elif m and line.strip() == m.group(1) and m.group(1).startswith(fence):
            doc.blocks.append(current)
            current, last_prose = None, ""
        else:
            drop = min(indent, len(line) - len(line.lstrip(" ")))
            current.lines.append(line[drop:])
    return doc


def code_blocks(chapter: Path) -> list[Block]:
    return read_document(chapter).blocks


# --- excerpts ---------------------------------------------------------------------------------------------------


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _parts(lines: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Split (chapter line, text) pairs at the elision lines; blank lines at a part's edges are dropped."""
    parts: list[list[tuple[int, str]]] = [[]]
    for number, text in lines:
        if text.strip() == ELISION:
            parts.append([])
        else:
            parts[-1].append((number, text.rstrip()))
    for part in parts:
        while part and not part[0][1]:
            part.pop(0)
        while part and not part[-1][1]:
            part.pop()
    return [p for p in parts if p]


def _matches(want: str, have: str, shift: int) -> bool:
    return have.rstrip() == " " * shift + want if want else not have.strip()


def _run_length(part: list[tuple[int, str]], file: list[str], at: int, shift: int) -> int:
    """How many lines of `part` match the file from line index `at` on."""
    n = 0
    while n < len(part) and at + n < len(file) and _matches(part[n][1], file[at + n], shift):
        n += 1
    return n


def match_excerpt(lines: list[tuple[int, str]], file: list[str]) -> str | None:
    """None if the lines are contiguous runs of the file in order, one per part; else why not, with a line number."""
    parts = _parts(lines)
    if not parts:
        return None
    first = parts[0][0][1]
    shifts = sorted({_indent(f) - _indent(first) for f in file if f.strip() == first.strip()})
    best: tuple[int, str] = (-1, f"{parts[0][0][0]}: not in the file: {first.strip()}")
    for shift in (s for s in shifts if s >= 0):
        at, why = 0, None
        for part in parts:
            starts = [i for i in range(at, len(file)) if _run_length(part, file, i, shift) == len(part)]
            if starts:
                at = starts[0] + len(part) + 1  # the next part comes after a gap of at least one line
                continue
            # The longest run of this part's opening lines, to say which line breaks it.
            n, i = max(((_run_length(part, file, i, shift), i) for i in range(at, len(file))), default=(0, 0))
            earlier = any(_run_length(part, file, i, shift) == len(part) for i in range(len(file)))
            number, text = part[min(n, len(part) - 1)]
            if earlier:
                why = f"{part[0][0]}: out of order, or a gap without a `...` line before it: {part[0][1].strip()}"
            elif n == 0:
                why = f"{number}: not in the file at this place: {text.strip()}"
            else:
                follows = file[i + n].strip() if i + n < len(file) else "the end of the file"
                why = f"{number}: the file has `{follows}` here, not `{text.strip()}` (copy it, or mark a gap with `...`)"
            progress = sum(len(p) for p in parts[: parts.index(part)]) + n
            if progress > best[0]:
                best = (progress, why)
            break
        if why is None:
            return None
    return best[1]


def _diff_side(body: list[tuple[int, str]], sign: str) -> list[tuple[int, str]]:
    """One side of a diff excerpt: context lines and the lines starting with `sign`, `@@` lines as gaps."""
    side = []
    for number, text in body:
        if text.startswith("@@") or text.strip() == ELISION:
            side.append((number, ELISION))
        elif not text.strip():
            side.append((number, ""))
        elif text[0] in " " + sign:
            side.append((number, text[1:]))
    return side


def check_excerpts(doc: Document, name: str, stage: str, commit: str | None, previous: str | None, files: Snapshots):
    where = f"stage {stage} ({commit[:10] if commit else 'the working tree'})"
    failures: list[str] = []
    for block in doc.blocks:
        m = HEADER.match(block.lines[0].strip()) if block.lines else None
        if not m:
            continue
        path = m.group(1)
        body = list(enumerate(block.lines[1:], start=block.start + 1))
        sides = [(commit, body, where)]
        if block.lang == "diff":
            bad = [n for n, t in body if t.strip() and t[:1] not in " +-@" and t.strip() != ELISION]
            failures += [f"{name}:{n}: {path}: a diff line starts with ' ', '+', '-' or '@@', or is `...`" for n in bad]
            sides = [(commit, _diff_side(body, "+"), where)]
            if any(t[:1] == "-" for _, t in body):
                if previous is None:
                    failures.append(f"{name}:{block.start}: {path}: removed lines, but no stage comes before {stage}")
                else:
                    sides.append((previous, _diff_side(body, "-"), f"the previous stage ({previous[:10]})"))
        for at, lines, label in sides:
            file = files.text(at, path)
            if file is None:
                failures.append(f"{name}:{block.start}: {path} does not exist at {label}")
                continue
            why = match_excerpt(lines, file)
            if why:
                failures.append(f"{name}:{why} [{path} at {label}]")
    return failures


# --- test names, commands, stage names ----------------------------------------------------------------------------


def _test_name_known(spec: str, names: set[str]) -> bool:
    """`test_x`, `tests/test_f.py::TestC::test_x`, `test_x[id]`, `test_x[a|b]` (each a part of some id) or
    `test_x[...]` (a parametrised test): every part is a collected name."""
    spec = spec.removeprefix("tests/")
    for part in spec.split("::"):
        base, _, rest = part.partition("[")
        if base not in names:
            return False
        if not rest:
            continue
        ids = [n[len(base) + 1 : -1] for n in names if n.startswith(base + "[")]
        if not ids or "*" in ids or rest[:-1] == "...":
            if not ids:
                return False  # not parametrised
            continue
        if not all(any(alt in i for i in ids) if "|" in rest else alt in ids for alt in rest[:-1].split("|")):
            return False
    return True


def _commands(block: Block) -> list[tuple[int, list[str]]]:
    """The simple commands of a bash block, as (chapter line, words), with `\\` continuations joined."""
    out: list[tuple[int, list[str]]] = []
    pending, first = "", 0
    for number, line in enumerate(block.lines, start=block.start):
        if not pending:
            first = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lexer = shlex.shlex(pending + line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        pending = ""
        try:
            words = list(lexer)
        except ValueError:  # an unbalanced quote: not a command line
            continue
        command: list[str] = []
        for word in [*words, ";"]:
            if word in {";", "&&", "||", "|", "&", "(", ")", ";;"} or (not command and word in {"do", "then", "else"}):
                if command:
                    out.append((first, command))
                command = []
            elif command or not re.fullmatch(r"[A-Za-z_]\w*=.*", word):  # `VAR=value` before a command
                command.append(word)
    return out


def _script(words: list[str]) -> str | None:
    """The repo file a command runs: `./x.sh`, `bash x.sh`, `python x.py`, `python -m roseinfer.mod`."""
    head = words[0]
    if head in {"timeout", "time", "env"}:
        return _script([w for w in words[1:] if not re.fullmatch(r"-\S+|\d+[smh]?", w)] or ["true"])
    if head in {"bash", "sh", "source", "."} and len(words) > 1:
        return words[1]
    if re.fullmatch(r"(?:\S*/)?python3?", head):
        args = words[1:]
        if "-m" in args and args.index("-m") + 1 < len(args):
            module = args[args.index("-m") + 1]
            return module.replace(".", "/") if module.split(".")[0] in {"roseinfer", "scripts"} else None
        return next((a for a in args if a.endswith(".py")), None)
    if head.startswith("./") or head.endswith(".sh"):
        return head
    return None


def _script_exists(path: str, commit: str | None, files: Snapshots) -> bool:
    if "." not in Path(path).name:  # python -m pkg.mod: a module or a package with __main__
        return files.exists(commit, path + ".py") or files.exists(commit, path + "/__main__.py")
    return files.exists(commit, path)


def _section(doc: Document, line: int) -> str:
    """The `## ` heading a chapter line is under."""
    return next((t[3:].strip() for n, t in reversed(doc.prose) if n < line and t.startswith("## ")), "")


def _paragraph(doc: Document, line: int) -> str:
    """The prose paragraph a line is in, or for a code block's first line the paragraph above the block."""
    lines = dict(doc.prose)
    start = line if lines.get(line, "").strip() else max((n for n in lines if n < line and lines[n].strip()), default=0)
    text = []
    n = start
    while lines.get(n, "").strip():
        text.insert(0, lines[n])
        n -= 1
    n = start + 1
    while lines.get(n, "").strip():
        text.append(lines[n])
        n += 1
    return " ".join(text)


def check_commands_and_tests(doc: Document, name: str, stage: str, commits: dict[str, str], files: Snapshots):
    """Test names, scripts and stage names. A test or script newer than the stage may be named where the
    paragraph says it is run in "the main checkout" (it must exist in the working tree), and a test of the
    previous stage where the paragraph says it is "removed"."""
    commit = commits.get(stage)
    number = stage.split("-", 1)[0]
    failures: list[str] = []

    def known_test(spec: str, line: int) -> bool:
        if _test_name_known(spec, files.tests(commit)):
            return True
        paragraph = _paragraph(doc, line)
        if "main checkout" in paragraph and _test_name_known(spec, files.tests(None)):
            return True
        previous = previous_commit(stage, commits)
        return "removed" in paragraph and previous is not None and _test_name_known(spec, files.tests(previous))

    for line, text in doc.prose:
        for spec in TEST_SPAN.findall(text):
            if not known_test(spec, line):
                failures.append(f"{name}:{line}: no test `{spec}` in tests/ at stage {stage}")
    for line, text in doc.prose + [(b.start + i, t) for b in doc.blocks for i, t in enumerate(b.lines)]:
        for m in STAGE_NAME.finditer(text):
            if m.group(0).removeprefix("stage-") not in commits and m.group(1) != number:
                failures.append(f"{name}:{line}: no stage is called `{m.group(0)}`")
    for block in doc.blocks:
        if block.lang not in {"bash", "sh", "shell", "console"}:
            continue
        in_run_box = _section(doc, block.start) == "Run this chapter"
        commands = _commands(block)
        # The lines before `cd ../roseinfer-NN` run in this checkout, the rest in the stage's.
        here = None if any(re.match(r"cd \.\./roseinfer-\d\d\b", " ".join(w)) for _, w in commands) else commit
        main_checkout = "main checkout" in _paragraph(doc, block.start - 1)
        written = {w[w.index(">") + 1] for _, w in commands if ">" in w[:-1]}  # files the block itself writes
        for line, words in commands:
            joined = " ".join(words)
            if m := re.match(r"cd \.\./roseinfer-(\d\d)\b", joined):
                if in_run_box and m.group(1) != number:
                    failures.append(f"{name}:{line}: the run box goes to ../roseinfer-{m.group(1)}, not -{number}")
                here = commit
                continue
            if in_run_box and (m := re.match(r"git worktree add (\S+) (\S+)", joined)):
                if (m.group(1), m.group(2)) != (f"../roseinfer-{number}", f"stage-{stage}"):
                    failures.append(f"{name}:{line}: the run box checks out stage-{stage} into ../roseinfer-{number}")
            script = _script(words)
            if script and script.startswith("/"):
                failures.append(f"{name}:{line}: `{script}` is a path of one machine (a stage is ../roseinfer-NN)")
            elif script and not script.startswith(("$", "~")):
                at, path = here, script.removeprefix("./")
                if m := re.match(r"\.\./roseinfer-(\d\d)/(.+)", path):
                    at, path = next((c for s, c in commits.items() if s.startswith(m.group(1) + "-")), None), m.group(2)
                if script in written or _script_exists(path, at, files):
                    pass
                elif not (main_checkout and _script_exists(path, None, files)):
                    label = f"stage {stage}" if at == commit else "this checkout" if at is None else at[:10]
                    failures.append(f"{name}:{line}: `{script}` does not exist at {label}")
            names = files.tests(commit) | (files.tests(None) if main_checkout else set())
            for m in TEST_NODE.finditer(joined):
                spec = m.group(1) + m.group(2) + (m.group(3) or "")
                if not _test_name_known(spec, names):
                    failures.append(f"{name}:{line}: no test `tests/{spec}` at stage {stage}")
            if "-k" in words[:-1] and (words[0].endswith("test.sh") or "pytest" in words):
                for word in re.findall(r"\w+", words[words.index("-k") + 1]):
                    if word not in {"and", "or", "not"} and not any(word.lower() in n.lower() for n in names):
                        failures.append(f"{name}:{line}: `-k {word}` matches no test at stage {stage}")
    return failures


# --- words, local paths, output marks -----------------------------------------------------------------------------

# A path only one machine has: a home or work folder anywhere, a temporary folder in captured output.
LOCAL_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|Users|root|mnt)/[\w.-]")
TEMP_PATH = re.compile(r"(?<![\w.~-])/(?:tmp|var/folders)/[\w.-]")


def check_words(doc: Document, name: str) -> list[str]:
    """Goal-talk and placeholders in the prose; local paths anywhere."""
    failures: list[str] = []
    comment = False
    for line, text in doc.prose:
        prose = re.sub(r"`[^`]*`", "``", text)
        if "<!--" in prose or comment:  # an HTML comment is not prose
            comment = "-->" not in prose.split("<!--")[-1]
            prose = re.sub(r"<!--.*?(-->|$)", "", prose)
        for pattern, why in GOAL_TALK_RE:
            if m := pattern.search(prose):
                failures.append(f"{name}:{line}: {why}, not a statement of what the code does or measured: {m.group(0)!r}")
    outputs = [b for b in doc.blocks if b.lang in {"", "text", "console"} and not (b.lines and HEADER.match(b.lines[0]))]
    for line, text in doc.prose + [(b.start + i, t) for b in doc.blocks for i, t in enumerate(b.lines)]:
        if m := LOCAL_PATH.search(text):
            failures.append(f"{name}:{line}: a path of one machine (use a relative path or `<path>`): {m.group(0)}...")
    for line, text in [(b.start + i, t) for b in outputs for i, t in enumerate(b.lines)]:
        if m := TEMP_PATH.search(text):
            failures.append(f"{name}:{line}: a path of one machine (use a relative path or `<path>`): {m.group(0)}...")
    return failures


def check_marks(doc: Document, name: str) -> list[str]:
    """An `<!-- output: COMMAND -->` block follows a ```bash block that shows COMMAND."""
    failures: list[str] = []
    shown: list[str] = []
    for block in doc.blocks:
        if block.mark is not None and block.mark not in shown:
            failures.append(f"{name}:{block.start - 1}: the output's command is not in the ```bash block above it: {block.mark}")
        if block.lang in {"bash", "sh", "shell", "console"}:
            shown = [re.sub(r"\s+#.*$", "", t).strip() for t in block.lines]
    marks = [n for n, t in doc.prose if OUTPUT_MARK.match(t)]
    used = {b.start - 1 for b in doc.blocks if b.mark is not None}
    failures += [f"{name}:{n}: an output mark must be the last line before a fenced block" for n in marks if n not in used and n + 1 not in used]
    return failures


def check_layout(doc: Document, name: str) -> list[str]:
    """README.md's Layout block names every module of roseinfer/ (one line each), and only modules that exist."""
    section = [b for b in doc.blocks if _section(doc, b.start) == "Layout" and b.lines and b.lines[0] == "roseinfer/"]
    if not section:
        return [f"{name}: no Layout block that starts with `roseinfer/`"]
    listed: dict[str, int] = {}
    stack: list[tuple[int, str]] = []
    for number, line in enumerate(section[0].lines, start=section[0].start):
        if not line.strip() or not re.match(r"\s*[\w.-]+(/[\w.-]+)*/?(\s|$)", line):
            continue
        indent, word = _indent(line), line.split()[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([s for _, s in stack] + [word.rstrip("/")])
        if word.endswith("/"):
            stack.append((indent, word.rstrip("/")))
        elif path.endswith(".py"):
            listed[path] = number
    def has_code(path: str) -> bool:  # a package's __init__.py with only its docstring is the folder itself
        body = ast.parse((REPO / path).read_text(encoding="utf-8")).body
        return not path.endswith("__init__.py") or len(body) > (1 if body and isinstance(body[0], ast.Expr) else 0)

    modules = {p for p in git("ls-files", "roseinfer").split() if p.endswith(".py") and has_code(p)}
    failures = [f"{name}:{section[0].start}: the Layout block does not list {m}" for m in sorted(modules - set(listed))]
    failures += [f"{name}:{n}: the Layout block lists {p}, which is not a module" for p, n in listed.items() if p not in modules]
    return failures


def stage_of(chapter: Path) -> str:
    return chapter.parent.name  # NN-slug


def previous_commit(stage: str, commits: dict[str, str]) -> str | None:
    number = int(stage.split("-", 1)[0])
    below = sorted((int(s.split("-", 1)[0]), c) for s, c in commits.items() if int(s.split("-", 1)[0]) < number)
    return below[-1][1] if below else None


def check_chapter(chapter: Path, commits: dict[str, str], files: Snapshots) -> list[str]:
    """Every failure of one chapter, as `chapter:line: why`."""
    doc = read_document(chapter)
    stage = stage_of(chapter)
    name = str(chapter.relative_to(REPO) if chapter.is_relative_to(REPO) else chapter)
    return (
        check_excerpts(doc, name, stage, commits.get(stage), previous_commit(stage, commits), files)
        + check_commands_and_tests(doc, name, stage, commits, files)
        + check_words(doc, name)
        + check_marks(doc, name)
    )


def chapter_paths(args: list[str]) -> list[Path]:
    """`chapters/NN-x/README.md`, `chapters/NN-x` or `NN`; none: every chapter."""
    every = sorted(REPO.glob("chapters/[0-9][0-9]-*/README.md"))
    out = []
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
    args = parser.parse_args(argv)
    chapters = chapter_paths(args.chapters)
    commits, files = stage_commits(), Snapshots()
    if args.outputs:
        import chapter_outputs

        return chapter_outputs.main(chapters, commits)
    failures: list[str] = []
    excerpts = 0
    for chapter in chapters:
        excerpts += sum(1 for b in code_blocks(chapter) if b.lines and HEADER.match(b.lines[0].strip()))
        failures += check_chapter(chapter, commits, files)
    if not args.chapters:
        readme = read_document(REPO / "README.md")
        failures += check_words(readme, "README.md") + check_layout(readme, "README.md")
    for failure in failures:
        print(failure)
    print(f"{len(chapters)} chapters, {excerpts} excerpts, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
