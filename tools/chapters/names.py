"""Names a chapter uses, checked at its stage: tests, scripts it runs, stage tags.

    `test_x` / `test_x[id]` / `tests/test_f.py::test_x`   a test collected from tests/ at the stage
    ./x.sh, bash x.sh, python scripts/x.py, python -m m   a file of the stage (before `cd ../roseinfer-NN`: of this
                                                         checkout, the run box's first lines)
    -k "a or b"                                          every word matches some test's name
    stage-NN-slug                                        a stage that exists

Tests are collected with `ast`, not by importing them: functions and methods named `test*`, classes named
`Test*` (also `TestX = Machine.TestCase`), and for a literal `@pytest.mark.parametrize` the ids pytest gives
(stacked decorators: `inner-outer`). A chapter writes `test_x[a|b]` for several ids and `test_x[...]` for all.

Two exceptions, each needing words in the same paragraph: a test or script newer than the stage where the
paragraph says it runs in "the main checkout" (it must exist in the working tree), and a test of the previous
stage where the paragraph says it is "removed".
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

from tools.chapters.doc import SHELL, Block, Document, Snapshots, commit_of_number, previous_commit

STAGE_NAME = re.compile(r"\bstage-(\d\d)-[a-z0-9-]*[a-z0-9]")
TEST_SPAN = re.compile(r"`((?:tests/)?test_\w+(?:\.py)?(?:::\w+)*(?:\[[^\]`]*\])?|Test\w+(?:::\w+)*)`")
TEST_NODE = re.compile(r"\btests/(test_\w+\.py)((?:::\w+)*)(\[[^\]\s]*\])?")
CD_STAGE = re.compile(r"cd \.\./roseinfer-(\d\d)\b")


def collected_tests(files: Snapshots, commit: str | None) -> set[str]:
    """Every name a test goes by at a commit: `test_f.py`, `test_f`, `test_x`, `test_x[id]`, `TestC`; `test_x[*]`
    for a test whose parametrisation is not literal (any id)."""
    key = ("tests", commit)
    if key not in files.memo:
        names: set[str] = set()
        for name in files.listing(commit, "tests"):
            if name.startswith("test_") and name.endswith(".py"):
                tree = ast.parse("\n".join(files.text(commit, f"tests/{name}") or []))
                names |= {name, name[:-3]} | test_names(tree, lambda folder: files.listing(commit, folder))
        files.memo[key] = names
    return files.memo[key]


def test_names(tree: ast.Module, listing) -> set[str]:
    """The test functions, Test classes and methods of a module, and `name[id]` for their parametrisations."""
    assigned = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if hasattr(t, "id")}
    names = {n for n in assigned if n.startswith("Test")}

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
    """The ids of a test's `@pytest.mark.parametrize` cases: [] without any, None if they are not literal."""
    ids: list[str] = []
    for dec in reversed(node.decorator_list):  # the decorator next to the function comes first in an id
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
    """A literal, `range(...)`, or `[p.name for p in FILES]` over a module-level `(... / "dir").glob("*.x")`."""
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
        source = assigned.get(getattr(expr.generators[0].iter, "id", ""))
        nodes = list(ast.walk(source)) if source is not None else []
        globs = [c for c in nodes if isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "glob" and c.args]
        strings = [c.value for c in nodes if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        if len(globs) == 1 and isinstance(globs[0].args[0], ast.Constant) and len(strings) == 2:
            pattern = globs[0].args[0].value
            found = [f for f in listing(next(s for s in strings if s != pattern)) if Path(f).match(pattern)]
            return found if expr.elt.attr == "name" else [Path(f).stem for f in found]
    return None


def test_name_known(spec: str, names: set[str]) -> bool:
    """Every `::` part of the spec is a collected name; `[a|b]`: each a part of some id; `[...]`: parametrised."""
    for part in spec.removeprefix("tests/").split("::"):
        base, bracket, rest = part.partition("[")
        if base not in names:
            return False
        if not bracket:
            continue
        ids = [n[len(base) + 1 : -1] for n in names if n.startswith(base + "[")]
        wanted = rest.removesuffix("]")
        if not ids:
            return False  # not parametrised
        if "*" in ids or wanted == "...":
            continue
        alternatives = wanted.split("|")
        if not all(any(a in i for i in ids) if len(alternatives) > 1 else a in ids for a in alternatives):
            return False
    return True


def commands(block: Block) -> list[tuple[int, list[str]]]:
    """The simple commands of a shell block, as (chapter line, words); `\\` continuations are joined."""
    out: list[tuple[int, list[str]]] = []
    pending, first = "", 0
    for number, line in enumerate(block.lines, start=block.start):
        first = first if pending else number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lexer = shlex.shlex(pending + line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters, pending = True, "#", ""
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


def script_of(words: list[str]) -> str | None:
    """The repo file a command runs: `./x.sh`, `bash x.sh`, `python x.py`, `python -m roseinfer.mod` (a path
    without a suffix: a module or a package with __main__)."""
    head = words[0]
    if head in {"timeout", "time", "env"}:
        return script_of([w for w in words[1:] if not re.fullmatch(r"-\S+|\d+[smh]?", w)] or ["true"])
    if head in {"bash", "sh", "source", "."} and len(words) > 1:
        return words[1]
    if re.fullmatch(r"(?:\S*/)?python3?", head):
        args = words[1:]
        if "-m" in args[:-1]:
            module = args[args.index("-m") + 1]
            packages = {"roseinfer", "scripts", "benchmarks", "tools"}
            return module.replace(".", "/") if module.split(".")[0] in packages else None
        return next((a for a in args if a.endswith(".py")), None)
    return head if head.startswith("./") or head.endswith(".sh") else None


def script_exists(path: str, commit: str | None, files: Snapshots) -> bool:
    if "." not in Path(path).name:
        return files.exists(commit, path + ".py") or files.exists(commit, path + "/__main__.py")
    return files.exists(commit, path)


def check_names(doc: Document, stage: str, commits: dict[str, str], files: Snapshots) -> list[str]:
    commit, number, name = commits.get(stage), stage.split("-", 1)[0], doc.name
    previous = previous_commit(stage, commits)
    failures: list[str] = []

    def known(spec: str, paragraph: str) -> bool:
        return (
            test_name_known(spec, collected_tests(files, commit))
            or ("main checkout" in paragraph and test_name_known(spec, collected_tests(files, None)))
            or ("removed" in paragraph and previous is not None
                and test_name_known(spec, collected_tests(files, previous)))
        )  # fmt: skip

    for line, text in doc.prose:
        for spec in TEST_SPAN.findall(text):
            if not known(spec, doc.paragraph(line)):
                failures.append(f"{name}:{line}: no test `{spec}` in tests/ at stage {stage}")
    for line, text in doc.lines():
        for m in STAGE_NAME.finditer(text):
            if m.group(0).removeprefix("stage-") not in commits and m.group(1) != number:
                failures.append(f"{name}:{line}: no stage is called `{m.group(0)}`")
    for block in (b for b in doc.blocks if b.lang in SHELL):
        failures += _check_shell_block(doc, block, stage, commits, files, known)
    return failures


def _check_shell_block(doc: Document, block: Block, stage: str, commits, files: Snapshots, known) -> list[str]:
    commit, number, name = commits.get(stage), stage.split("-", 1)[0], doc.name
    run_box = doc.section(block.start) == "Run this chapter"
    paragraph = doc.paragraph(block.start - 1)
    main_checkout = "main checkout" in paragraph
    lines = commands(block)
    here = None if any(CD_STAGE.match(" ".join(w)) for _, w in lines) else commit  # before the `cd`: this checkout
    written = {w[w.index(">") + 1] for _, w in lines if ">" in w[:-1]}  # files the block itself writes
    names = collected_tests(files, commit) | (collected_tests(files, None) if main_checkout else set())
    failures: list[str] = []
    for line, words in lines:
        joined = " ".join(words)
        if m := CD_STAGE.match(joined):
            if run_box and m.group(1) != number:
                failures.append(f"{name}:{line}: the run box goes to ../roseinfer-{m.group(1)}, not -{number}")
            here = commit
            continue
        m = re.match(r"git worktree add (\S+) (\S+)", joined)
        if run_box and m and (m.group(1), m.group(2)) != (f"../roseinfer-{number}", f"stage-{stage}"):
            failures.append(f"{name}:{line}: the run box checks out stage-{stage} into ../roseinfer-{number}")
        script = script_of(words)
        if script and script.startswith("/"):
            failures.append(f"{name}:{line}: `{script}` is a path of one machine (a stage is ../roseinfer-NN)")
        elif script and not script.startswith(("$", "~")) and script not in written:
            at, path = here, script.removeprefix("./")
            if m := re.match(r"\.\./roseinfer-(\d\d)/(.+)", path):
                at, path = commit_of_number(m.group(1), commits), m.group(2)
            if not script_exists(path, at, files) and not (main_checkout and script_exists(path, None, files)):
                label = f"stage {stage}" if at == commit else "this checkout" if at is None else at[:10]
                failures.append(f"{name}:{line}: `{script}` does not exist at {label}")
        for m in TEST_NODE.finditer(joined):
            if not known(m.group(1) + m.group(2) + (m.group(3) or ""), paragraph):
                failures.append(f"{name}:{line}: no test `{m.group(0)}` at stage {stage}")
        if "-k" in words[:-1] and (words[0].endswith("test.sh") or "pytest" in words):
            for word in re.findall(r"\w+", words[words.index("-k") + 1]):
                if word not in {"and", "or", "not"} and not any(word.lower() in n.lower() for n in names):
                    failures.append(f"{name}:{line}: `-k {word}` matches no test at stage {stage}")
    return failures
