"""Rerun the measurements behind the chapters, each at its own stage, and record them in results/.

    ./scripts/reproduce.sh                # every stage that has results/NN-slug/runs.toml
    ./scripts/reproduce.sh 05 09          # some stages
    ./scripts/reproduce.sh 09 --only gpt2-t2
    ./scripts/reproduce.sh --list         # what would run, and the data file of each

    results/NN-slug/runs.toml ──► [[run]] name, command, repeats (1), where ("stage" | "main"), record (true),
                                  exit_ok ([0]: the exit statuses that are a measurement, not a failure)
         │
         ▼ a worktree of stage NN (roseinfer-NN, beside any ../roseinfer-MM a command names), sharing .venv
    bash -c COMMAND, `repeats` times ──► results/NN-slug/NAME.json
                                           {"stage", "commit", "command", "repeats", "machine", "recorded",
                                            "runs": [{"seconds", "output"}, ...], "median": text or null}

`median` is the output with every number that differs between runs replaced by its median over the runs (for
a table printed by a benchmark: the median of each cell, ratios included, i.e. the median of the in-run
ratios). It is null when the runs do not print the same shape (a different number of lines or words). A
script that gives its verdict by its exit status (a soak exits 1 when memory grew) is recorded either way when
its run lists both statuses in `exit_ok`; each run keeps its `exit_status`. Paths
of the run's folders are written as the chapters show them: `.` for the stage's checkout, `..` for the folder
the stages sit in. In a command, `{run}` is the run's number (1 to `repeats`) and `{repo}` this checkout (for
a script newer than the stage). Files a command writes under its checkout's results/NN-slug/ and figures under
chapters/NN-slug/ are copied into this checkout; a chapter names a data file with a `Data:` line, and
tools/chapters/data.py checks both against each other.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tomllib

from tools.chapters.doc import REPO, git, stage_commits
from tools.chapters.outputs import PROGRESS, Stages, run

RESULTS = REPO / "results"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class Run:
    stage: str  # NN-slug
    name: str
    command: str
    repeats: int = 1
    where: str = "stage"  # or "main": this checkout (a script newer than the stage that runs every stage)
    record: bool = True  # false: a setup step (a peer's virtualenv) whose output is no data
    timeout: int = 3600
    exit_ok: tuple[int, ...] = (0,)  # the statuses whose output is a measurement (a verdict of 1 included)

    @property
    def data(self) -> Path:
        return RESULTS / self.stage / f"{self.name}.json"


def load_runs(stage_dir: Path) -> list[Run]:
    spec = tomllib.loads((stage_dir / "runs.toml").read_text(encoding="utf-8"))
    runs = [Run(stage_dir.name, **{**e, "exit_ok": tuple(e.get("exit_ok", (0,)))}) for e in spec.get("run", [])]
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"{stage_dir / 'runs.toml'}: run names repeat: {names}")
    for r in runs:
        if r.where not in ("stage", "main") or r.repeats < 1:
            raise ValueError(f"{stage_dir / 'runs.toml'}: run {r.name!r}: where must be stage|main, repeats >= 1")
    return runs


def clean(output: str, folders: dict[str, str]) -> str:
    """What a terminal shows (the last redraw of a `\\r` line, no progress bars), with the run's folders named
    as a reader's checkout would be."""
    for path, name in sorted(folders.items(), key=lambda kv: -len(kv[0])):
        output = output.replace(path + "/", name + "/").replace(path, name)
    lines = [next((p for p in reversed(line.split("\r")) if p), "") for line in output.split("\n")]
    return "\n".join(line.rstrip() for line in lines if not PROGRESS.search(line)).strip("\n") + "\n"


def median_output(outputs: list[str]) -> str | None:
    """Each number that differs between the outputs becomes its median, written with as many decimals as the
    most precise run wrote it, in the first run's layout (a column keeps its right edge); None when the
    outputs differ in anything but numbers and spacing."""
    shapes = [NUMBER.split(o) for o in outputs]
    values = [NUMBER.findall(o) for o in outputs]
    flat = [[re.sub(r"[ \t]+", " ", part) for part in shape] for shape in shapes]
    if any(f != flat[0] for f in flat) or any(len(v) != len(values[0]) for v in values):
        return None
    out = shapes[0][0]
    for i, column in enumerate(zip(*values, strict=True)):
        cell = column[0]
        if len(set(column)) > 1:
            decimals = max(len(c.partition(".")[2]) for c in column)
            cell = f"{statistics.median(float(c) for c in column):.{decimals}f}"
        pad = len(column[0]) - len(cell)  # keep the right edge of a right-aligned column
        if pad > 0 and out.endswith(" "):
            out += " " * pad
        elif pad < 0 and out.endswith(" " * (1 - pad)):  # a wider cell eats spaces, leaving at least one
            out = out[:pad]
        out += cell + shapes[0][i + 1]
    return out


def machine() -> dict:
    model = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    return {"cpu": model, "cores": os.cpu_count(), "system": platform.system(), "python": platform.python_version()}


def snapshot(folder: Path) -> dict[str, float]:
    return {f.name: f.stat().st_mtime for f in folder.glob("*") if f.is_file()} if folder.is_dir() else {}


def copy_back(src: Path, dst: Path, before: dict[str, float], pattern: str = "*") -> list[str]:
    """The files under src that a run wrote (new, or changed since `before`), copied to dst; their names."""
    copied = []
    for f in sorted(src.glob(pattern)) if src.is_dir() else []:
        if f.is_file() and before.get(f.name) != f.stat().st_mtime and f.name != "runs.toml":
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def reproduce(r: Run, stages: Stages, commit: str | None) -> Path | None:
    where = REPO if r.where == "main" else stages.checkout(r.stage[:2])
    for number in sorted(set(re.findall(r"\.\./roseinfer-(\d\d)\b", r.command))):
        stages.checkout(number)
    folders = {str(REPO): "."} if r.where == "main" else {str(where): ".", str(stages.root): ".."}
    runs = []
    for i in range(1, r.repeats + 1):
        command = r.command.replace("{run}", str(i)).replace("{repo}", str(REPO))
        print(f"  {r.stage} {r.name} [{i}/{r.repeats}]: {command}", flush=True)
        results, figures = where / "results" / r.stage, where / "chapters" / r.stage
        before = (snapshot(results), snapshot(figures))
        start = time.perf_counter()
        status, output = run(command, where, stages.root / "torch_extensions" / where.name, r.timeout)
        seconds = round(time.perf_counter() - start, 1)
        if status not in r.exit_ok:
            raise RuntimeError(f"{r.stage} {r.name}: exit status {status}\n{output[-3000:]}")
        runs.append({"seconds": seconds, "output": clean(output, folders)})
        if status:
            runs[-1]["exit_status"] = status  # a verdict the run allows (exit_ok)
        if where != REPO:
            copy_back(results, RESULTS / r.stage, before[0])
            copy_back(figures, REPO / "chapters" / r.stage, before[1], "*.png")
    if not r.record:
        return None
    record = {
        "stage": r.stage,
        "commit": commit if r.where == "stage" else stage_head(),
        "where": r.where,
        "command": r.command,
        "repeats": r.repeats,
        "machine": machine(),
        "recorded": datetime.date.today().isoformat(),
        "runs": runs,
        "median": median_output([x["output"] for x in runs]) if r.repeats > 1 else runs[0]["output"],
    }
    r.data.parent.mkdir(parents=True, exist_ok=True)
    r.data.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return r.data


def recorded_seconds(r: Run) -> float | None:
    """How long the run's last recording took, all repeats together; None if it has no record with times."""
    if not r.record or not r.data.is_file():
        return None
    runs = json.loads(r.data.read_text(encoding="utf-8")).get("runs")
    return sum(x["seconds"] for x in runs) if isinstance(runs, list) else None


def stage_head() -> str:
    return git("rev-parse", "HEAD").strip()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stages", nargs="*", help="two-digit stage numbers (default: every results/NN-slug/runs.toml)")
    ap.add_argument("--only", nargs="+", help="run names within those stages")
    ap.add_argument("--list", action="store_true", help="print the runs and their data files; run nothing")
    ap.add_argument("--workdir", type=Path, help="keep the stage worktrees in this folder")
    args = ap.parse_args(argv)
    dirs = sorted(p.parent for p in RESULTS.glob("[0-9][0-9]-*/runs.toml"))
    if args.stages:
        dirs = [d for d in dirs if d.name[:2] in {f"{int(s):02d}" for s in args.stages}]
    runs = [r for d in dirs for r in load_runs(d) if not args.only or r.name in args.only]
    if args.list:
        total, unknown = 0.0, 0
        for r in runs:
            data = r.data.relative_to(REPO) if r.record else "(no data: setup)"
            seconds = recorded_seconds(r)
            total += seconds or 0.0
            unknown += seconds is None and r.record
            took = "      " if seconds is None else f"{seconds / 60:5.1f}m"
            print(f"{r.stage:28} {r.name:24} x{r.repeats} {took} {data}\n    {r.command}")
        print(f"{len(runs)} runs; their last recorded runs took {total / 60:.0f} minutes", end="")
        print(f", and {unknown} have no record yet" if unknown else "")
        return 0
    commits = stage_commits()
    os.environ["ROSEINFER_SAVE_FIGURES"] = "1"
    stages = Stages(commits, args.workdir)
    try:
        for r in runs:
            data = reproduce(r, stages, commits.get(r.stage))
            if data:
                print(f"  -> {data.relative_to(REPO)}", flush=True)
    finally:
        stages.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
