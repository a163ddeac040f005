"""The chapters quote the code as it is: scripts/check_chapters.py, and its convention."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import check_chapters  # noqa: E402


def test_every_chapter_excerpt_is_in_its_stage():
    proc = subprocess.run([sys.executable, "scripts/check_chapters.py"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _check(tmp_path, stage: str, text: str) -> list[str]:
    chapter = tmp_path / stage / "README.md"
    chapter.parent.mkdir(exist_ok=True)
    chapter.write_text(text)
    return check_chapters.check_chapter(chapter, check_chapters.stage_commits(), check_chapters.Snapshots())


def test_an_excerpt_must_match_its_stage(tmp_path):
    ok = "```python\n# roseinfer/session.py\n    def append_token(self, token_id: int) -> None:\n        ...\n```\n"
    assert _check(tmp_path, "03-offline-scheduler", ok) == []
    bad = "text\n\n```python\n# roseinfer/session.py\n        self.detokenizer.step(token_id)\n```\n"
    (failure,) = _check(tmp_path, "03-offline-scheduler", bad)
    assert ":5: roseinfer/session.py: not in the file at stage 03-offline-scheduler" in failure
    missing = "```\n# roseinfer/session.py\nx = 1\n```\n"  # no session.py before stage 03
    assert "does not exist at stage 02-kv-cache" in _check(tmp_path, "02-kv-cache", missing)[0]
    plain = "```python\nfrom roseinfer import LLM\n```\n"  # no header: not an excerpt
    assert _check(tmp_path, "03-offline-scheduler", plain) == []


def test_a_diff_excerpt_reads_minus_lines_at_the_previous_stage(tmp_path):
    diff = (
        "```diff\n# roseinfer/session.py\n@@ append_token @@\n"
        "         self.output_ids.append(token_id)\n"
        "-        self.last_delta = self.detokenizer.step(token_id)\n"
        "+        self.last_delta = self.detokenizer.step(token_id)\n```\n"
    )
    failures = _check(tmp_path, "04-kv-block-manager", diff)  # session.py is new in stage 03: the - line passes
    assert failures == []
    (failure,) = _check(tmp_path, "03-offline-scheduler", diff)  # stage 02 has no session.py
    assert ":5: roseinfer/session.py: the file does not exist at the previous stage" in failure


def test_a_chapter_without_a_stage_commit_is_checked_against_the_working_tree(tmp_path):
    text = "```python\n# roseinfer/config.py\n" + (REPO / "roseinfer/config.py").read_text().splitlines()[0] + "\n```\n"
    assert _check(tmp_path, "99-not-yet-written", text) == []


def test_a_block_inside_a_list_item_is_read_without_its_indentation(tmp_path):
    diff = (
        "1. A step:\n\n   ```diff\n   # roseinfer/session.py\n"
        "   -        self.last_delta = self.detokenizer.step(token_id)\n"
        "   +        self.last_delta = self.detokenizer.step(token_id)\n   ```\n"
    )
    assert _check(tmp_path, "04-kv-block-manager", diff) == []
