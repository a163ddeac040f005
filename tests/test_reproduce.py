"""The chapters' numbers come from results/: tools/chapters/reproduce.py records them, tools/chapters/data.py checks
the chapters against the records."""

from __future__ import annotations

import json

import pytest
import tomllib
from conftest import REPO

from tools.chapters import check as check_chapters
from tools.chapters import reproduce
from tools.chapters.data import check_data, sync
from tools.chapters.doc import read_document, stage_commits
from tools.chapters.outputs import Stages

STAGE03 = "03-offline-scheduler"
RECORD03 = "results/03-offline-scheduler/offline-requests.json"


def test_the_median_output_takes_each_differing_number_over_the_runs():
    runs = ["rate 10.0 tok/s, 2.00x, r1\n", "rate 30.5 tok/s, 1.50x, r1\n", "rate 20 tok/s, 3.00x, r1\n"]
    assert reproduce.median_output(runs) == "rate 20.0 tok/s, 2.00x, r1\n"
    assert reproduce.median_output(["a 1\nb 2\n", "a 3\nb 4\n"]) == "a 2\nb 3\n"  # an even count: the mean of two
    assert reproduce.median_output(["a 1\n", "b 1\n"]) is None  # not the same shape
    columns = ["x   8.88 y\n", "x  10.21 y\n", "x  12.50 y\n"]  # widths differ, the right edge stays
    assert reproduce.median_output(columns) == "x  10.21 y\n"
    assert reproduce.median_output(columns[1:] + columns[:1]) == "x  10.21 y\n"
    assert reproduce.median_output(["a 1\n", "a 1 2\n"]) is None


def test_the_output_is_what_a_terminal_shows_with_the_reader_s_folders():
    out = "wrote /tmp/w/roseinfer-05/chapters/x.png\r\n 50%|##  |\rdone\n/tmp/w/roseinfer-03/a\n\x1b"
    cleaned = reproduce.clean(out, {"/tmp/w/roseinfer-05": ".", "/tmp/w": ".."})
    assert cleaned.splitlines()[:3] == ["wrote ./chapters/x.png", "done", "../roseinfer-03/a"]


def test_runs_toml_is_checked(tmp_path):
    folder = tmp_path / "05-x"
    folder.mkdir()
    (folder / "runs.toml").write_text('[[run]]\nname = "a"\ncommand = "x"\n[[run]]\nname = "a"\ncommand = "y"\n')
    with pytest.raises(ValueError, match="repeat"):
        reproduce.load_runs(folder)
    (folder / "runs.toml").write_text('[[run]]\nname = "a"\ncommand = "x"\nwhere = "gpu"\n')
    with pytest.raises(ValueError, match="where"):
        reproduce.load_runs(folder)


def test_every_record_in_results_comes_from_a_run_of_its_stage():
    for toml in sorted(REPO.glob("results/[0-9][0-9]-*/runs.toml")):
        runs = {r.name: r for r in reproduce.load_runs(toml.parent)}
        assert runs, toml
        for data in toml.parent.glob("*.json"):
            record = json.loads(data.read_text())
            if not {"stage", "command", "runs", "median"} <= set(record):  # a file a command wrote (--json)
                continue
            assert data.stem in runs, f"{data}: no run named {data.stem} in {toml}"
            assert record["command"] == runs[data.stem].command, data
            assert record["stage"] == toml.parent.name and len(record["runs"]) == runs[data.stem].repeats, data
            assert all(isinstance(run["seconds"], float) for run in record["runs"])


def test_a_run_is_recorded_at_its_stage_with_the_median(tmp_path, monkeypatch):
    monkeypatch.setattr(reproduce, "RESULTS", tmp_path / "results")
    commits = stage_commits()
    stages = Stages(commits, None)
    run = reproduce.Run(STAGE03, "probe", "ls scripts/offline_example.py; pwd; echo 'took {run}.5 s'", repeats=3)
    try:
        data = reproduce.reproduce(run, stages, commits[STAGE03])
    finally:
        stages.close()
    record = json.loads(data.read_text())
    assert data == tmp_path / "results" / STAGE03 / "probe.json"
    assert record["commit"] == commits[STAGE03] and record["command"] == run.command
    assert [r["output"] for r in record["runs"]][1] == "scripts/offline_example.py\n.\ntook 2.5 s\n"
    assert record["median"] == "scripts/offline_example.py\n.\ntook 2.5 s\n"


def test_a_verdict_by_exit_status_is_recorded_only_where_the_run_allows_it(tmp_path, monkeypatch):
    """A soak prints its numbers and exits 1 when memory grew: with exit_ok = [0, 1] that is a record (each run
    keeps its status); without, it is a failure, and nothing is written."""
    monkeypatch.setattr(reproduce, "RESULTS", tmp_path / "results")
    commits = stage_commits()
    stages = Stages(commits, None)
    verdict = "echo 'slope +44.6 MiB/min: NOT flat'; exit 1"
    try:
        data = reproduce.reproduce(reproduce.Run(STAGE03, "soak", verdict, exit_ok=(0, 1)), stages, commits[STAGE03])
        with pytest.raises(RuntimeError, match="exit status 1"):
            reproduce.reproduce(reproduce.Run(STAGE03, "strict", verdict), stages, commits[STAGE03])
    finally:
        stages.close()
    assert json.loads(data.read_text())["runs"][0] == {"seconds": pytest.approx(0, abs=30), "exit_status": 1,
                                                       "output": "slope +44.6 MiB/min: NOT flat\n"}  # fmt: skip
    assert not (tmp_path / "results" / STAGE03 / "strict.json").exists()


def _chapter(tmp_path, text: str):
    chapter = tmp_path / STAGE03 / "README.md"
    chapter.parent.mkdir(exist_ok=True)
    chapter.write_text(text)
    return read_document(chapter)


OUTPUT03 = json.loads((REPO / RECORD03).read_text())["runs"][0]["output"]
SHOWN03 = f"## 5. Measured\n\n```bash\npython scripts/measure_offline.py\n```\n\nData: `{RECORD03}`.\n\n"


def test_a_measured_number_needs_a_data_line_in_its_section(tmp_path):
    assert "names no Data: file" in check_data(_chapter(tmp_path, "## 5. Measured\n\nIt ran at 726 tokens/s.\n"))[0]
    assert "names no Data: file" in check_data(_chapter(tmp_path, "## 5\n\n```\nx 14.09 s\n```\n"))[0]
    assert "names no Data: file" in check_data(_chapter(tmp_path, "## 5\n\nThat is 1.62× faster.\n"))[0]
    for fine in ["the 400s and 500s", "`--timeout 120 s`", "3 × 4 blocks", "[A paper](https://x) saw 2.5x."]:
        assert check_data(_chapter(tmp_path, f"## 5\n\n{fine}\n")) == [], fine
    assert check_data(_chapter(tmp_path, SHOWN03 + "So 400 tokens/s.\n")) == []


def test_a_block_after_a_data_line_is_its_output(tmp_path):
    good = SHOWN03 + f"```\n{OUTPUT03}```\n"
    assert check_data(_chapter(tmp_path, good)) == []
    first, *_ = OUTPUT03.splitlines()
    assert check_data(_chapter(tmp_path, SHOWN03 + f"```\n{first}\n...\n```\n")) == []  # `...` skips lines
    edited = good.replace(OUTPUT03.splitlines()[-1], OUTPUT03.splitlines()[-1] + "9")
    assert (
        "is not results/03-offline-scheduler/offline-requests.json's output"
        in check_data(_chapter(tmp_path, edited))[0]
    )
    doc = _chapter(tmp_path, edited)
    assert sync(doc) == 1 and check_data(read_document(doc.path)) == []


def test_a_wrapped_data_line_and_a_continued_command(tmp_path):
    wrapped = SHOWN03.replace("Data: `", "Data: the table,\nfrom `") + "```\nnot the output\n```\n"
    assert (
        "is not results/03-offline-scheduler/offline-requests.json's output"
        in check_data(_chapter(tmp_path, wrapped))[0]
    )


def test_a_data_file_exists_and_its_command_is_shown(tmp_path):
    missing = check_data(_chapter(tmp_path, "## 5\n\nData: `results/03-offline-scheduler/nope.json`.\n"))
    assert "no such data file" in missing[0]
    unshown = check_data(_chapter(tmp_path, SHOWN03.replace("measure_offline.py", "offline_example.py")))
    assert "does not show `python scripts/measure_offline.py`" in unshown[0]
    report = "## 5\n\nIt took 21 minutes.\nData: `roseinfer/models/tiny-llama-shakespeare/training_report.json`.\n"
    assert check_data(_chapter(tmp_path, report)) == []
    elsewhere = check_data(_chapter(tmp_path, report.replace("models/tiny-llama-shakespeare/training_report", "x")))
    assert "names no `results/...` file" in elsewhere[0]


def test_runs_toml_files_use_only_known_keys():
    for toml in sorted(REPO.glob("results/[0-9][0-9]-*/runs.toml")):
        spec = tomllib.loads(toml.read_text())
        assert all(
            set(r) <= {"name", "command", "repeats", "where", "record", "timeout", "exit_ok"} for r in spec["run"]
        ), toml


def test_sync_data_rewrites_from_the_command_line(tmp_path):
    doc = _chapter(tmp_path, SHOWN03 + "```\nold\n```\n")
    assert check_chapters.main(["--sync-data", str(doc.path)]) == 0
    assert OUTPUT03.splitlines()[0] in doc.path.read_text()
