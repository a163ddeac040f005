"""`check_chapters.py --outputs`: rerun every marked output of the chapters at its stage and compare.

    <!-- output: ./generate.sh -->            the block below is what `./generate.sh` prints, every run
    <!-- output (timed): ./online_example.sh -->   the same, but its decimal numbers are timings

    chapter NN ──► TMP/roseinfer-NN: a worktree of stage NN (`git worktree add`), sharing this checkout's .venv
                   (scripts/share_venv.sh), named as the run box names it, so `../roseinfer-08` in a command is
                   stage 08 (made when a command names it)
               ──► bash -c COMMAND there, .venv/bin first on PATH (in this checkout instead when the paragraph
                   above the command says it runs in "the main checkout")
               ──► its output (stdout and stderr, as a terminal shows them) and the block, both normalised,
                   compared line by line

Normalised on both sides: this run's folders become `.` (the command's checkout) and `..` (where the stages
sit); any other absolute path under /tmp, /work, /home becomes `<path>`; host:port `<port>`; `pid N`, `worker N`,
`kill -9 N` `<pid>`; a number with a time unit (`1.15s`, `12 ms`) `<time>`, with a rate unit (`111.3 tokens/s`)
`<rate>`; with `(timed)`, every decimal number `<t>`; runs of blanks one blank; progress bars and blank lines at
the ends are dropped. A `$ COMMAND` first line of the block is not output. The block's `...` lines skip output
lines as in an excerpt; without one at its start or end, the block runs from the output's first line to its last.
Each checkout builds its C++ kernels in a TORCH_EXTENSIONS_DIR of its own: the stages give a kernel the same name
whatever its source, and a build shared between two sources can load the other's.

Slow (every marked command runs), so not part of the test command: `python scripts/check_chapters.py --outputs
[NN ...]`; `--workdir DIR` keeps the worktrees in DIR for the next run.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from tools.chapters.doc import ELISION, REPO, SHELL, Block, Document, commit_of_number, git, read_document
from tools.chapters.excerpts import match_excerpt

START, END = "<start of output>", "<end of output>"
PROGRESS = re.compile(r"\d+%\|")  # a progress bar (tqdm), redrawn in place on a terminal


def normalise(text: str, folders: dict[str, str], timed: bool) -> list[str]:
    for path, name in sorted(folders.items(), key=lambda kv: -len(kv[0])):  # the longest first
        text = text.replace(path, name)
    text = re.sub(r"(?<![\w.~-])/(?:tmp|work|home|Users|root|var/folders)/[^\s'\",:;)\]]*", "<path>", text)
    text = re.sub(r"\b(127\.0\.0\.1|localhost|0\.0\.0\.0):\d+", r"\1:<port>", text)
    text = re.sub(r"\b(pid|PID|worker|kill -9)([ =:]+)\d+", r"\1\2<pid>", text)
    text = re.sub(r"\d[\d,]*(?:\.\d+)?\s*(?:tok(?:ens)?|req(?:uests)?|it|steps?)/s\b", "<rate>", text)
    text = re.sub(r"\d[\d,]*(?:\.\d+)?\s*(?:ns|us|µs|ms|s|sec|seconds?|min)\b", "<time>", text)
    if timed:
        text = re.sub(r"\d[\d,]*\.\d+", "<t>", text)
    shown = [next((part for part in reversed(line.split("\r")) if part), "") for line in text.split("\n")]  # \r redraws
    lines: list[str] = []
    after_bar = False
    for line in shown:  # a progress bar, and the blank line it may leave, are not output
        if PROGRESS.search(line) or (after_bar and not line.strip()):
            after_bar = bool(PROGRESS.search(line))
            continue
        after_bar = False
        lines.append(re.sub(r"\s+", " ", line).strip())
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def match_output(want: list[str], have: list[str], first_line: int) -> str | None:
    """None if the block's lines `want` are the output `have`: all of it, unless `...` opens or closes the
    block; `...` inside skips lines as in an excerpt. `first_line` is the chapter line of want[0]."""
    want = list(want)
    if not (want and want[0] == ELISION):
        want.insert(0, START)
    if want[-1:] != [ELISION]:
        want.append(END)
    return match_excerpt(list(enumerate(want, start=first_line - 1)), [START, *have, END])


def compare(block: Block, stdout: str, folders: dict[str, str]) -> str | None:
    """None if the block is the output; else why not, and a diff."""
    shown = list(block.lines)
    while shown and shown[0].startswith("$ "):
        shown.pop(0)
    want = normalise("\n".join(shown), folders, block.timed)
    have = normalise(stdout, folders, block.timed)
    why = match_output(want, have, block.start)
    if why is None:
        return None
    diff = difflib.unified_diff(want, have, "chapter", "rerun", lineterm="", n=1)
    return why + "\n" + "\n".join(list(diff)[:60])


class Stages:
    """Worktrees of the stages in one folder, named roseinfer-NN, made when first asked for."""

    def __init__(self, commits: dict[str, str], workdir: Path | None) -> None:
        self.commits = commits
        self.keep = workdir is not None
        self.root = (workdir or Path(tempfile.mkdtemp(prefix="roseinfer-outputs-"))).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.made: list[Path] = []

    def checkout(self, number: str) -> Path:
        path = self.root / f"roseinfer-{number}"
        commit = commit_of_number(number, self.commits)
        if commit is None:
            raise ValueError(f"no stage {number}")
        if path.exists() and git("-C", str(path), "rev-parse", "HEAD").strip() != commit:
            raise ValueError(f"{path} is not stage {number} ({commit[:10]}); remove it")
        if not path.exists():
            git("worktree", "add", "--detach", str(path), commit)
            subprocess.run([str(REPO / "scripts/share_venv.sh"), str(path)], cwd=REPO, check=True, capture_output=True)
            self.made.append(path)
        return path

    def close(self) -> None:
        if self.keep:
            return
        for path in self.made:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)


def run(command: str, where: Path, extensions: Path, timeout: int) -> tuple[int, str]:
    """(exit status, what a terminal would show: stdout and stderr as they come, `\r` kept)."""
    venv = where / ".venv"
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", "VIRTUAL_ENV": str(venv)}
    # C++ kernels build for each checkout apart: stages share a kernel's name, not its source
    env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr in the order a terminal shows them
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        ["bash", "-c", command], cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout
    )
    return proc.returncode, proc.stdout.decode("utf-8", errors="replace")


def check_doc(doc: Document, stage: str, stages: Stages, timeout: int) -> tuple[int, list[str]]:
    """(outputs checked, failures) of one chapter."""
    failures: list[str] = []
    marked = [b for b in doc.blocks if b.mark is not None]
    for block in marked:
        shells = [b for b in doc.blocks if b.lang in SHELL and b.start < block.start]
        main = "main checkout" in doc.paragraph(shells[-1].start - 1 if shells else block.start - 2)
        where = REPO if main else stages.checkout(stage.split("-", 1)[0])
        for number in sorted(set(re.findall(r"\.\./roseinfer-(\d\d)\b", block.mark))):
            stages.checkout(number)
        label = f"{doc.name}:{block.start - 1}: `{block.mark}` ({'main checkout' if main else where.name})"
        print(f"running {label}", flush=True)
        try:
            status, output = run(block.mark, where, stages.root / "torch_extensions" / where.name, timeout)
        except subprocess.TimeoutExpired:
            failures.append(f"{label}: no output within {timeout} s")
            continue
        if status != 0:
            failures.append(f"{label}: exit status {status}\n{output[-2000:]}")
            continue
        folders = {str(where): ".", str(where.parent): ".."} if not main else {str(REPO): "."}
        folders[str(stages.root)] = ".."
        if why := compare(block, output, folders):
            failures.append(f"{label}: the output differs: {why}")
    return len(marked), failures


def main(chapters: list[Path], commits: dict[str, str], workdir: Path | None, timeout: int) -> int:
    stages = Stages(commits, workdir)
    checked, failures = 0, []
    try:
        for chapter in chapters:
            n, f = check_doc(read_document(chapter), chapter.parent.name, stages, timeout)
            checked, failures = checked + n, failures + f
    finally:
        stages.close()
    for failure in failures:
        print(failure)
    print(f"{len(chapters)} chapters, {checked} marked outputs rerun, {len(failures)} differ or fail")
    return 1 if failures else 0
