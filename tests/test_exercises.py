"""Build it yourself (scripts/exercise.sh): every stage has an exercise; its stubs are functions of the stage
that its chapter names in order; the grader fails on the stubs and passes on the stage's code; and the stub
maker changes nothing but the bodies it stubs.

The grader runs here on each manifest's quick tests (about 10 s a stage); the whole proof, every stage's
full tests on all stubs, on each stub alone and on the stage's code, is `./scripts/exercise.sh --prove
--per-stub` (half an hour on two cores)."""

from __future__ import annotations

import ast
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO

from tools.exercises import exercise
from tools.exercises.stub import is_stubbed, replace_function, stub_source

MANIFESTS = exercise.manifests()
COMMITS = exercise.stage_commits()  # NN-slug -> commit, from the Stage: trailers (no tags needed)
STAGES = sorted(m.nn for m in MANIFESTS.values() if m.stage in COMMITS)  # committed stages with an exercise
no_history = pytest.mark.skipif(not COMMITS, reason="no `Stage:` commits in this clone's history (a shallow clone?)")


def at_stage(m: exercise.Manifest, path: str) -> str:
    """A file as the stage has it; a manifest whose stage is not committed yet is read from the working tree."""
    if m.stage not in COMMITS:
        return (REPO / path).read_text()
    return exercise.git("show", f"{COMMITS[m.stage]}:{path}")


# ---- the manifests ---------------------------------------------------------------------------------------
@no_history
def test_every_stage_has_an_exercise():
    stages = {s for s in COMMITS if re.fullmatch(r"\d\d-[a-z0-9-]+", s)}
    assert stages <= {m.stage for m in MANIFESTS.values()}, "add exercises/NN-slug.toml for every stage"
    for m in MANIFESTS.values():
        assert 2 <= len(m.stubs) <= 6, f"{m.stage}: 2 to 6 stubs"
        assert len({s.name for s in m.stubs}) == len(m.stubs), f"{m.stage}: a stub twice"
        assert all(s.hint.strip() and "\n" not in s.hint for s in m.stubs), f"{m.stage}: one line of hint each"
        assert m.quick, f"{m.stage}: quick tests (what this suite runs)"


@no_history
@pytest.mark.parametrize("nn", sorted(MANIFESTS))
def test_every_stub_is_a_function_of_its_stage_and_every_quick_test_exists(nn):
    m = MANIFESTS[nn]
    for s in m.stubs:
        source = at_stage(m, s.file)
        stubbed = stub_source(source, s.name, m.message(s))  # the function exists and is not a one-liner
        assert is_stubbed(stubbed, s.name, m.nn) and not is_stubbed(source, s.name, m.nn)
        compile(stubbed, s.file, "exec")
    files = m.tests or [p for p in _test_files(m) if Path(p).name.startswith(f"test_{m.nn}_")]
    names = {n.name for f in files for n in ast.walk(ast.parse(at_stage(m, f))) if isinstance(n, ast.FunctionDef)}
    quick = {name for q in m.quick for name in re.findall(r"\btest_\w+", q)}  # (-k expressions: names, and ...)
    assert quick and quick <= names, f"{m.stage}: quick tests that are not in {files}: {sorted(quick - names)}"


def _test_files(m: exercise.Manifest) -> list[str]:
    if m.stage not in COMMITS:
        return [str(p.relative_to(REPO)) for p in sorted((REPO / "tests").glob(f"test_{m.nn}_*.py"))]
    return exercise.git("ls-tree", "--name-only", COMMITS[m.stage], "tests/").split()


@pytest.mark.parametrize("nn", sorted(MANIFESTS))
def test_each_chapter_names_its_stubs_in_order_and_the_two_commands(nn):
    m = MANIFESTS[nn]
    text = (REPO / m.chapter).read_text()
    found = re.search(r"^## \d+\. Build it yourself\n(.*?)(?=^## )", text, re.M | re.S)
    assert found, f"{m.chapter}: no section 'Build it yourself'"
    section = found.group(1)
    at = [section.find(f"`{s.name}`") for s in m.stubs]
    assert -1 not in at and at == sorted(at), f"{m.chapter}: the stubs, in the manifest's order"
    assert f"./scripts/exercise.sh {nn} " in section and "./scripts/exercise.sh --check " in section


# ---- the stub maker --------------------------------------------------------------------------------------
SOURCE = '''import functools


class Pool:
    @functools.cache
    def slot(self, seq_id: str,
             position: int) -> int:  # fmt: skip
        """The pool slot of a token."""
        # translate: block, then offset
        table = self.tables[seq_id]
        return table[position // 16] * 16 + position % 16
        # (a comment after the last line)

    def blocks(self):
        """Every block, lazily."""
        yield from range(4)


def total(xs):
    return sum(x for x in xs)
'''


def test_a_stub_replaces_only_the_body_and_keeps_decorators_signature_and_docstring():
    out = stub_source(SOURCE, "Pool.slot", "exercise 07: table[pos // bs] * bs + pos % bs")
    assert out.splitlines()[:8] == SOURCE.splitlines()[:8]  # up to and with the docstring
    assert out.splitlines()[8] == '        raise NotImplementedError("exercise 07: table[pos // bs] * bs + pos % bs")'
    assert out.splitlines()[9:] == SOURCE.splitlines()[12:]  # the body, its comments too, went; the rest stays
    assert is_stubbed(out, "Pool.slot", "07") and not is_stubbed(out, "Pool.slot", "08")
    assert replace_function(out, SOURCE, "Pool.slot") == SOURCE  # the stage's function back: the same file


def test_a_generator_stays_a_generator_and_a_long_hint_is_wrapped():
    out = stub_source(SOURCE, "Pool.blocks", "exercise 10: " + "word " * 40)
    ns: dict = {}
    exec(compile(out, "pool.py", "exec"), ns)
    gen = ns["Pool"]().blocks()  # calling it makes a generator; running it raises
    with pytest.raises(NotImplementedError, match="exercise 10: word"):
        next(gen)
    assert max(map(len, out.splitlines())) <= 120
    body = stub_source(SOURCE, "total", "exercise 01: sum them")  # no docstring: the whole body goes
    assert "def total(xs):\n    raise NotImplementedError" in body


def test_what_cannot_be_stubbed_is_a_clear_error():
    with pytest.raises(LookupError, match="no function 'Pool.grow'"):
        stub_source(SOURCE, "Pool.grow", "exercise 07: x")
    with pytest.raises(ValueError, match="one-line function"):
        stub_source("def f(): return 1\n", "f", "exercise 01: x")
    with pytest.raises(ValueError, match="double quotes"):
        stub_source(SOURCE, "total", 'exercise 01: say "hi"')


# ---- the grader, at every stage ----------------------------------------------------------------------------
def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=900)


def prove_quick(nn: str, tmp: Path) -> str:
    """Make stage nn's exercise; its quick tests must fail on the stubs (-x: at the first failure) and pass once
    `--restore` has put the stage's functions back, which leaves the tree the stage's. '' when all holds."""
    d = tmp / f"ex{nn}"
    made = run("./scripts/exercise.sh", nn, str(d))
    try:
        if made.returncode != 0:
            return f"{nn}: exercise.sh {nn} failed: {made.stderr[-2000:]}"
        on_stubs = run("./scripts/exercise.sh", "--check", str(d), "--quick", "-x")
        if on_stubs.returncode != 1 or "Next stub to fill" not in on_stubs.stdout:
            return f"{nn}: the grader did not fail on the stubs:\n{on_stubs.stdout[-3000:]}{on_stubs.stderr[-2000:]}"
        run("./scripts/exercise.sh", "--restore", str(d))
        sha = COMMITS[MANIFESTS[nn].stage]
        changes = run("git", "status", "--porcelain", cwd=d).stdout + run("git", "diff", sha, cwd=d).stdout
        if changes.strip():
            return f"{nn}: restored, the tree still differs from the stage:\n{changes[:3000]}"
        on_code = run("./scripts/exercise.sh", "--check", str(d), "--quick")
        if on_code.returncode != 0 or "The quick tests pass" not in on_code.stdout:
            return f"{nn}: the grader failed on the stage's code:\n{on_code.stdout[-3000:]}{on_code.stderr[-2000:]}"
        return ""
    finally:
        run("git", "worktree", "remove", "--force", str(d))


@no_history
def test_the_grader_fails_on_the_stubs_and_passes_on_the_stage_code_at_every_stage(tmp_path):
    """Two stages at a time: most of the cost is starting pytest (torch, transformers) twice a stage."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        problems = [p for p in pool.map(lambda nn: prove_quick(nn, tmp_path), STAGES) if p]
    assert not problems, "\n\n".join(problems)


@no_history
@pytest.mark.skipif("04" not in STAGES, reason="stage 04 is not committed")
def test_the_grader_runs_the_stage_tests_whatever_the_checkout_holds(tmp_path):
    d = tmp_path / "ex04"
    assert run("./scripts/exercise.sh", "04", str(d)).returncode == 0
    try:
        run("./scripts/exercise.sh", "--restore", str(d))  # all written ...
        graded = d / "tests" / "test_04_block_manager.py"
        graded.write_text("def test_nothing():\n    pass\n")  # ... but a test file swapped for an empty one
        (d / "tests" / "test_04_mine.py").write_text("def test_mine():\n    assert False\n")  # and one added
        (d / "roseinfer" / "block_manager.py").write_text(
            (d / "roseinfer" / "block_manager.py").read_text().replace("return AllocStatus.NEVER", "return None")
        )
        out = run("./scripts/exercise.sh", "--check", str(d), "--quick")
        assert out.returncode == 1, out.stdout
        assert "restored 1 file(s)" in out.stdout and "test_can_allocate_ok_later_never" in out.stdout
        assert "test_mine" not in out.stdout  # only the stage's own test files are graded
        (d / "conftest.py").write_text("")  # a conftest of one's own could change any outcome: refused
        refused = run("./scripts/exercise.sh", "--check", str(d))
        assert refused.returncode != 0 and "remove conftest.py" in refused.stderr
    finally:
        run("git", "worktree", "remove", "--force", str(d))
