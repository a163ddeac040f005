"""Build it yourself: a stage's code with the functions its chapter teaches left for you to write,
graded by the stage's own tests.

    ./scripts/exercise.sh 07 ~/ex07          ~/ex07 = stage 07 as tagged, its taught functions stubbed
    ./scripts/exercise.sh --check ~/ex07     run stage 07's tests there: which pass, which stub is next

`exercise.sh` makes the git worktree and shares the venv; this file does the rest:

    new NN DIR       stub DIR (a fresh worktree of stage NN) and write its marker, DIR/.exercise/
    check DIR        the grader: the stage's tests/test_NN_*.py as git holds them at the stage's commit
    restore DIR      put the stage's own functions back into the stubs ("the answer"), all or --only some
    prove [NN ...]   every stage: the grader fails on the stubs (and, --per-stub, on each stub alone) and
                     passes on the stage's code; slow, it runs the stages' tests (the suite runs --quick)
    list             the stages and their stubs
    commit NN        stage NN's commit, from the `Stage:` trailers (so no tags are needed)

The manifests, one per stage, are exercises/NN-slug.toml at HEAD: stages are fixed history, so a
manifest is applied to the stage's code, never stored in it. A stage joins the track with its manifest:

    quick = ["test_reference_paged_attention_equals_dense"]   # fast tests (-k expressions) reaching every stub
    tests = ["tests/test_07_paged_kv_cache.py"]                 # optional: the grader's files (default test_NN_*)

    [[stub]]                                     # one per function, in the order to write them
    file = "roseinfer/attention/reference.py"
    name = "paged_attention_reference"           # a function, or Class.method
    hint = "gather each row's blocks through its block table, ..."   # one line: what to write

(`quick` and `tests` come first: in TOML a key after a [[stub]] header belongs to that stub.)

How a stub is made: tools/exercises/stub.py. How a test's outcome is recorded: tools/exercises/exercise_grader.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomllib  # Python 3.11 (scripts/setup.sh makes .venv with python3.11)

from benchmarks.common import git
from tools.chapters.doc import stage_commits  # (the Stage: trailers, so a clone without tags works too)
from tools.exercises.stub import is_stubbed, replace_function, stub_source

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "exercises"
MARKER = ".exercise"  # DIR/.exercise/: exercise.json, the grader's plugin and its reports; ignored by git


# ---- manifests -------------------------------------------------------------------------------------------
@dataclass
class Stub:
    file: str  # path in the repository, e.g. roseinfer/block_manager.py
    name: str  # `function` or `Class.method`
    hint: str  # one line: what to write


@dataclass
class Manifest:
    stage: str  # NN-slug: the stage's tag without "stage-"
    stubs: list[Stub]
    quick: list[str] = field(default_factory=list)  # names of fast tests that reach the stubs
    tests: list[str] = field(default_factory=list)  # the grader's test files; default tests/test_NN_*.py

    @property
    def nn(self) -> str:
        return self.stage[:2]

    @property
    def chapter(self) -> str:
        return f"chapters/{self.stage}/README.md"

    def message(self, stub: Stub) -> str:
        return f"exercise {self.nn}: {stub.hint}"


def load_manifest(path: Path) -> Manifest:
    data = tomllib.loads(path.read_text())
    unknown = set(data) - {"stub", "quick", "tests"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    keys = {"file", "name", "hint"}
    bad = [sorted(set(s) ^ keys) for s in data.get("stub", []) if set(s) != keys]
    if bad:  # (a key written after a [[stub]] belongs to that stub: top-level keys go first)
        raise ValueError(f"{path}: a [[stub]] has exactly file, name and hint; extra or missing: {bad}")
    stubs = [Stub(s["file"], s["name"], s["hint"]) for s in data.get("stub", [])]
    return Manifest(path.stem, stubs, list(data.get("quick", [])), list(data.get("tests", [])))


def manifests() -> dict[str, Manifest]:
    """NN -> manifest, for every exercises/NN-slug.toml."""
    return {m.nn: m for m in map(load_manifest, sorted(MANIFESTS.glob("[0-9][0-9]-*.toml")))}


def resolve(nn: str) -> tuple[Manifest, str]:
    """A stage number -> its manifest and commit; a clear error when either is missing."""
    nn = f"{int(nn):02d}" if nn.isdigit() else nn
    table = manifests()
    if nn not in table:
        raise SystemExit(f"no exercise for stage {nn!r}; there are: {' '.join(sorted(table))}")
    sha = stage_commits().get(table[nn].stage)
    if sha is None:
        raise SystemExit(f"no `Stage: {table[nn].stage}` commit in this clone's history (a shallow clone?)")
    return table[nn], sha


# ---- new, restore -----------------------------------------------------------------------------------------
def chosen(m: Manifest, only: list[str] | None) -> list[Stub]:
    """The stubs named in `only` (all when None); an unknown name is an error that lists the known ones."""
    unknown = sorted(set(only or ()) - {s.name for s in m.stubs})
    if unknown:
        known = ", ".join(s.name for s in m.stubs)
        raise SystemExit(f"stage {m.stage} has no stub {', '.join(unknown)}; its stubs: {known}")
    return [s for s in m.stubs if only is None or s.name in only]


def apply_stubs(dir_: Path, m: Manifest, only: list[str] | None = None) -> None:
    for s in chosen(m, only):
        path = dir_ / s.file
        path.write_text(stub_source(path.read_text(), s.name, m.message(s)))


def read_marker(dir_: Path) -> tuple[dict, Manifest]:
    path = dir_ / MARKER / "exercise.json"
    if not path.exists():
        raise SystemExit(f"{dir_} is not an exercise (it has no {MARKER}/): make one with ./scripts/exercise.sh NN DIR")
    info = json.loads(path.read_text())
    m = manifests().get(info["nn"])
    if m is None:
        raise SystemExit(f"no manifest exercises/{info['stage']}.toml in {REPO}")
    return info, m


def cmd_new(args: argparse.Namespace) -> int:
    m, sha = resolve(args.nn)
    dir_ = Path(args.dir).resolve()
    if git("rev-parse", "HEAD", cwd=dir_).strip() != sha:
        raise SystemExit(f"{dir_} is not a checkout of stage {m.stage} ({sha[:10]})")
    (dir_ / MARKER).mkdir(exist_ok=True)
    (dir_ / MARKER / ".gitignore").write_text("*\n")  # git ignores the directory: itself and all in it
    (dir_ / MARKER / "exercise.json").write_text(json.dumps({"nn": m.nn, "stage": m.stage, "commit": sha}) + "\n")
    apply_stubs(dir_, m, args.only)
    print(f"{dir_}: stage {m.stage}, {len(m.stubs)} functions to write, in this order:\n")
    for i, s in enumerate(m.stubs, 1):
        print(f"  {i}. {s.file}: {s.name}\n     {s.hint}")
    print(f"\nRead {m.chapter} (section 'Build it yourself'); then, after each function:\n")
    print(f"  ./scripts/exercise.sh --check {dir_}    # stage {m.nn}'s own tests; exit 0 when all pass")
    print(f"  git -C {dir_} diff                     # what you have written")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    """The stage's own functions back in place of the stubs (all, or --only these); the rest of DIR stays."""
    dir_ = Path(args.dir).resolve()
    info, m = read_marker(dir_)
    stubs = chosen(m, args.only)
    for s in stubs:
        path, original = dir_ / s.file, git("show", f"{info['commit']}:{s.file}", cwd=dir_)
        try:
            path.write_text(replace_function(path.read_text(), original, s.name))
        except SyntaxError as e:
            raise SystemExit(f"{s.file} does not parse ({e.msg}, line {e.lineno}): fix it, or git checkout it") from e
    print(f"restored from stage {m.stage}: {', '.join(s.name for s in stubs)}")
    return 0


# ---- check: the grader --------------------------------------------------------------------------------------
def grader_tests(dir_: Path, commit: str, m: Manifest) -> list[str]:
    """The stage's test files, as git holds them at its commit (what DIR holds does not count)."""
    names = m.tests or git("ls-tree", "--name-only", commit, "tests/", cwd=dir_).split()
    return [n for n in names if m.tests or (Path(n).name.startswith(f"test_{m.nn}_") and n.endswith(".py"))]


def restore_grader(dir_: Path, commit: str) -> list[str]:
    """tests/ and the pytest configuration back as they are at the stage's commit; returns what differed.
    Untracked files that pytest would also load (another conftest.py, a pytest.ini) are refused."""
    changed = git("diff", "--name-only", commit, "--", "tests", "pyproject.toml", cwd=dir_).split()
    tracked = git("ls-tree", "-r", "--name-only", commit, "tests/", cwd=dir_).split()
    gone = [p for p in tracked if not (dir_ / p).exists()]
    if changed or gone:
        git("checkout", commit, "--", "tests", "pyproject.toml", cwd=dir_)
    extra = git("ls-files", "--others", "--exclude-standard", cwd=dir_).split()
    bad = [p for p in extra if Path(p).name in ("conftest.py", "pytest.ini", "tox.ini", "setup.cfg")]
    if bad:
        raise SystemExit(f"the grader runs the stage's tests only: remove {', '.join(bad)} from {dir_}")
    return sorted(set(changed + gone))


def run_grader(dir_: Path, files: list[str], quick: list[str], exitfirst: bool, timeout: float,
               verbose: bool = False, show=None) -> tuple[int, list[dict]]:  # fmt: skip
    """pytest on `files` in DIR, with DIR's venv and DIR's roseinfer. `show(record)` is called for each test
    as it finishes. Returns pytest's exit code and one record per test (tools/exercises/exercise_grader.py)."""
    python = dir_ / ".venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{dir_} has no .venv: run ./scripts/share_venv.sh {dir_}")
    marker = dir_ / MARKER
    shutil.copy(Path(__file__).with_name("exercise_grader.py"), marker)  # loaded with -p from DIR/.exercise
    report, log = marker / "report.jsonl", marker / "last-run.log"
    report.unlink(missing_ok=True)
    cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-p", "exercise_grader", "-q", "--tb=short",
           f"--confcutdir={dir_ / 'tests'}", f"--exercise-report={report}", f"--exercise-timeout={timeout}",
           *files]  # fmt: skip
    cmd += ["-k", " or ".join(f"({q})" for q in quick)] if quick else []
    cmd += ["-x"] if exitfirst else []
    env = {k: v for k, v in os.environ.items() if k not in ("ROSEINFER_VENV", "PYTHONPATH")}
    env["PYTHONPATH"] = f"{dir_}{os.pathsep}{marker}"
    # C++ extensions (stage 17's decode kernel) are built once per stage in a directory of its own: one
    # name with a different source per stage, in a shared directory, makes graders that run side by side
    # (or a grader beside this checkout's tests) rebuild it over each other and load the wrong one.
    ext = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    stage = json.loads((marker / "exercise.json").read_text())["stage"]
    env["TORCH_EXTENSIONS_DIR"] = str(ext / f"roseinfer-exercise-{stage}")
    by_id: dict[str, dict] = {}  # a test whose teardown fails after it passed counts once, as an error
    with open(log, "w") as out:
        # Ctrl-C as in a terminal, even when the grader itself runs in the background (where SIGINT is ignored,
        # and children inherit that): some stages test how their processes stop on it.
        sigint = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
        proc = subprocess.Popen(cmd, cwd=dir_, env=env, stdout=None if verbose else out, stderr=subprocess.STDOUT,
                                preexec_fn=sigint)  # fmt: skip
        seen = 0
        try:
            while True:
                done = proc.poll() is not None
                lines = report.read_text().splitlines() if report.exists() else []
                for rec in map(json.loads, lines[seen:]):
                    if rec["nodeid"] not in by_id or rec["outcome"] == "error":
                        by_id[rec["nodeid"]] = rec
                    if show is not None:
                        show(rec)
                seen = len(lines)
                if done:
                    return proc.returncode, list(by_id.values())
                time.sleep(0.2)
        finally:  # Ctrl-C, a closed pipe: pytest does not outlive the grader
            if proc.poll() is None:
                proc.terminate()
                proc.wait()


def show_record(m: Manifest):
    """Print a test's outcome on one line; a failure that is a stub's NotImplementedError names the stub."""
    stub_of = {m.message(s)[:60]: s.name for s in m.stubs}

    def show(rec: dict) -> None:
        mark = {"passed": "pass", "failed": "FAIL", "skipped": "skip", "error": "ERROR"}[rec["outcome"]]
        why = rec.get("message", "")
        at = why.find(f"exercise {m.nn}: ")  # (Triton's interpreter wraps the NotImplementedError in its own)
        if at >= 0 and why[at : at + 60] in stub_of:
            why = f"reaches the stub {stub_of[why[at : at + 60]]}"
        print(f"  {mark:5} {rec['nodeid'].removeprefix('tests/')}" + (f"   {why[:120]}" if why else ""), flush=True)

    return show


def next_stub(dir_: Path, m: Manifest) -> tuple[Stub | None, str]:
    """The first stub, in the manifest's order, that is still a stub (and why it cannot be read, if so)."""
    for s in m.stubs:
        try:
            if is_stubbed((dir_ / s.file).read_text(), s.name, m.nn):
                return s, ""
        except SyntaxError as e:
            return s, f" ({s.file} does not parse: {e.msg}, line {e.lineno})"
        except (LookupError, FileNotFoundError) as e:
            return s, f" ({s.file}: {e})"
    return None, ""


def cmd_check(args: argparse.Namespace) -> int:
    dir_ = Path(args.dir).resolve()
    info, m = read_marker(dir_)
    restored = restore_grader(dir_, info["commit"])
    if restored:
        print(f"restored {len(restored)} file(s) to stage {m.stage}, the grader's: {' '.join(restored)}")
    files = grader_tests(dir_, info["commit"], m)
    quick = m.quick if args.quick else []
    print(f"grading {dir_} with stage {m.stage}'s {' '.join(files)}" + (" (its quick tests)" if quick else ""))
    rc, records = run_grader(dir_, files, quick, args.exitfirst, args.timeout, args.verbose, show_record(m))
    count = {k: sum(r["outcome"] == k for r in records) for k in ("passed", "failed", "error", "skipped")}
    ran = count["passed"] + count["failed"] + count["error"]
    ok = rc == 0 and count["passed"] > 0
    stub, why = next_stub(dir_, m)
    skipped = f" ({count['skipped']} skipped)" if count["skipped"] else ""
    print(f"\n{count['passed']}/{ran} tests pass{skipped}.", end=" ")
    if ok and quick:
        print("The quick tests pass; the grader is all of them: run it without --quick.")
    elif ok and stub is None:
        print(f"Stage {m.nn} is built. Compare with the stage's code: git -C {dir_} diff {info['commit'][:10]}")
    elif ok:
        print(f"{stub.name} is still a stub, and no test reaches it.")
    elif stub is not None:
        print(f"Next stub to fill: {stub.file}: {stub.name}{why}\n  {stub.hint}")
    else:
        print("No stub is left: the failures above are in your code.")
    if rc not in (0, 1):  # a collection error, an interrupted run: pytest's own words say why
        print(f"pytest exited with {rc}; the end of its output:\n" + _tail(dir_ / MARKER / "last-run.log"))
    elif not ok:
        print(f"(tracebacks: {dir_ / MARKER / 'last-run.log'})")
    return 0 if ok else 1


def _tail(path: Path, n: int = 30) -> str:
    return "".join(path.read_text().splitlines(keepends=True)[-n:]) if path.exists() else ""


# ---- prove: every stage's exercise, end to end -------------------------------------------------------------
def cmd_prove(args: argparse.Namespace) -> int:
    """For each stage in a fresh exercise: the grader fails on all stubs; with --per-stub it fails on each
    stub alone (so each is reached by the stage's tests); and it passes once the stage's code is restored,
    when the tree is the stage's again byte for byte. One JSON line per stage, then a summary."""
    todo = [f"{int(n):02d}" for n in args.nn] or sorted(manifests())
    failed = []
    for nn in todo:
        m, _ = resolve(nn)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"roseinfer-exercise-{nn}-") as tmp:
            dir_ = Path(tmp) / "ex"
            subprocess.run([str(REPO / "scripts" / "exercise.sh"), nn, str(dir_)], check=True, capture_output=True)
            try:
                row = _prove_one(dir_, m, args)
            finally:
                git("worktree", "remove", "--force", str(dir_), check=False)
        row["seconds"] = round(time.perf_counter() - t0)
        print(json.dumps({k: v for k, v in row.items() if k != "records"}), flush=True)
        if args.json:  # a line per stage as it is done, with every test's outcome and duration
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
        if not row["ok"]:
            failed.append(nn)
    good = len(todo) - len(failed)
    print(f"\n{good}/{len(todo)} stages: the grader fails on the stubs and passes on the stage's code", end="")
    print(f"; not: {' '.join(failed)}" if failed else "")
    return 1 if failed else 0


def _prove_one(dir_: Path, m: Manifest, args: argparse.Namespace) -> dict:
    commit = json.loads((dir_ / MARKER / "exercise.json").read_text())["commit"]
    files, quick = grader_tests(dir_, commit, m), (m.quick if args.quick else [])

    def grade(exitfirst: bool) -> tuple[bool, str, list[dict]]:
        rc, recs = run_grader(dir_, files, quick, exitfirst, args.timeout)
        fails = [r for r in recs if r["outcome"] in ("failed", "error")]
        passed = sum(r["outcome"] == "passed" for r in recs)
        return rc != 0 and bool(fails), f"{passed} pass, {len(fails)} fail, rc {rc}", recs

    failing, summary, _ = grade(exitfirst=False)
    row: dict = {"stage": m.stage, "stubs": len(m.stubs), "on_stubs": summary}
    ok = failing
    if args.per_stub:
        row["each_stub_alone"] = {}
        for s in m.stubs:
            _restore_files(dir_, commit, m)
            apply_stubs(dir_, m, [s.name])
            failing, _, recs = grade(exitfirst=True)
            first = next((r["nodeid"] for r in recs if r["outcome"] in ("failed", "error")), None)
            row["each_stub_alone"][s.name] = f"fails: {first}" if failing else "PASSES"
            ok = ok and failing
    _restore_files(dir_, commit, m)
    same = not git("status", "--porcelain", cwd=dir_).strip() and not git("diff", commit, cwd=dir_).strip()
    failing, summary, recs = grade(exitfirst=False)
    row["on_stage_code"] = summary + ("" if same else ", TREE DIFFERS FROM THE STAGE")
    row["ok"] = ok and same and summary.endswith("0 fail, rc 0") and any(r["outcome"] == "passed" for r in recs)
    row["records"] = recs  # durations: what --json keeps, to choose quick tests
    return row


def _restore_files(dir_: Path, commit: str, m: Manifest) -> None:
    for f in sorted({s.file for s in m.stubs}):
        (dir_ / f).write_text(git("show", f"{commit}:{f}", cwd=dir_))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    new = sub.add_parser("new", help="stub a fresh worktree of stage NN (exercise.sh makes it)")
    new.add_argument("nn")
    new.add_argument("dir")
    new.add_argument("--only", nargs="+", metavar="NAME", help="stub only these functions")
    check = sub.add_parser("check", help="grade DIR with its stage's tests")
    check.add_argument("dir")
    check.add_argument("--quick", action="store_true", help="only the manifest's quick tests")
    check.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failing test")
    check.add_argument("--timeout", type=float, default=300, help="seconds a test may take (default 300)")
    check.add_argument("-v", "--verbose", action="store_true", help="pytest's own output, as it runs")
    restore = sub.add_parser("restore", help="the stage's code back into the stubs (all, or --only NAME ...)")
    restore.add_argument("dir")
    restore.add_argument("--only", nargs="+", metavar="NAME")
    prove = sub.add_parser("prove", help="each stage: the grader fails on the stubs and passes on the stage's code")
    prove.add_argument("nn", nargs="*")
    prove.add_argument("--quick", action="store_true", help="only the manifests' quick tests")
    prove.add_argument("--per-stub", action="store_true", help="each stub alone must make the grader fail too")
    prove.add_argument("--timeout", type=float, default=120, help="seconds a test may take (default 120)")
    prove.add_argument("--json", metavar="FILE", help="append a JSON line per stage (all outcomes) here")
    sub.add_parser("list", help="the stages and their stubs")
    sub.add_parser("commit", help="stage NN's commit (exercise.sh checks it out)").add_argument("nn")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for m in manifests().values():
            print(f"{m.stage}: {', '.join(s.name for s in m.stubs)}")
        return 0
    if args.cmd == "commit":
        print(resolve(args.nn)[1])
        return 0
    return {"new": cmd_new, "check": cmd_check, "restore": cmd_restore, "prove": cmd_prove}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
