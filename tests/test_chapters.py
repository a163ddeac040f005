"""The chapters say only what their stage's code bears out: scripts/check_chapters.py, and its rules.

The checker reads files at each stage with `git show` (no worktrees), so it runs in the suite. Its slow mode,
`--outputs`, reruns the chapters' marked outputs at their stages; the last test runs it on one chapter when
ROSEINFER_CHECK_OUTPUTS=1 is set (`ROSEINFER_CHECK_OUTPUTS=1 ./scripts/test.sh -k outputs`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

from tools.chapters import check as check_chapters
from tools.chapters import outputs as chapter_outputs
from tools.chapters.doc import Block, read_document
from tools.chapters.words import goal_talk

STAGE03 = "03-offline-scheduler"


def test_every_chapter_passes_the_checker():
    proc = subprocess.run([sys.executable, "scripts/check_chapters.py"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " 0 failures" in proc.stdout


def test_no_goal_talk_or_placeholders_in_the_chapters_and_the_readme():
    found = []
    for path in [REPO / "README.md", *sorted(REPO.glob("chapters/[0-9][0-9]-*/README.md"))]:
        for line, text in read_document(path).prose:
            found += [f"{path.relative_to(REPO)}:{line}: {words!r} ({why})" for why, words in goal_talk(text)]
    assert found == []


@pytest.mark.parametrize(
    "sentence",
    [
        "The target of 1.5× is met at batch 1.",
        "That is short of the 2× this stage aimed for.",
        "A cost of 1 to 2%, under the 3% budget.",
        "It stays within budget.",
        "The speed target holds.",
        "Our goal is a fast engine.",
        "We set out to beat HF.",
        "Numbers: TODO.",
        "TBD",
        "A placeholder until the GPU run.",
        "It misses the target by 10%.",
    ],
)
def test_goal_talk_is_found(sentence):
    assert goal_talk(sentence), sentence


@pytest.mark.parametrize(
    "sentence",
    [
        "The scheduler fills a token budget of 32 tokens per step.",
        "A memory budget divided by the size of one block.",
        "The target model verifies the drafts; the target's own token comes last.",
        "A block freed by one is never the target of the other before its copy.",
        "One forward of the target over 5 tokens, a target step.",
        "`max_num_batched_tokens` is the budget; a budget below 1 is refused.",
        "The `target` variable and `TODO` inside code spans are code, not prose.",
        "<!-- output: ./generate.sh --goal -->",
    ],
)
def test_the_same_words_in_another_sense_pass(sentence):
    assert goal_talk(sentence) == [], sentence


def _check(tmp_path, stage: str, text: str) -> list[str]:
    chapter = tmp_path / stage / "README.md"
    chapter.parent.mkdir(exist_ok=True)
    chapter.write_text(text)
    return check_chapters.check_chapter(chapter, check_chapters.stage_commits(), check_chapters.Snapshots())


ADD_REQUEST = (
    "    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> str:\n"
    '        """Check and queue a request; bad input raises here and leaves the queue untouched."""\n'
    "        request_id = str(next(self._ids))\n"
)
STEP = "    def step(self) -> list[str]:\n"


def _excerpt(body: str) -> str:
    return f"```python\n# roseinfer/scheduler.py\n{body}```\n"


def test_an_excerpt_is_a_contiguous_run_of_its_file_at_the_stage(tmp_path):
    assert _check(tmp_path, STAGE03, _excerpt(ADD_REQUEST)) == []
    assert _check(tmp_path, STAGE03, _excerpt(ADD_REQUEST + "    ...\n" + STEP)) == []  # a gap, marked
    dedented = "".join(line[4:] + "\n" for line in ADD_REQUEST.splitlines())  # shown without its class
    assert _check(tmp_path, STAGE03, _excerpt(dedented)) == []

    (failure,) = _check(tmp_path, STAGE03, _excerpt(ADD_REQUEST + STEP))  # lines left out without `...`
    assert "the file has" in failure and "gap it with `...`" in failure
    (failure,) = _check(tmp_path, STAGE03, _excerpt(STEP + "    ...\n" + ADD_REQUEST))  # both parts exist
    assert "out of order" in failure
    lines = ADD_REQUEST.splitlines(keepends=True)
    (failure,) = _check(tmp_path, STAGE03, _excerpt(lines[0] + lines[2]))  # the docstring dropped
    assert ":4: the file has" in failure  # the chapter line of the first line that breaks the run
    retyped = ADD_REQUEST.replace("untouched", "unchanged")
    assert "not `" in _check(tmp_path, STAGE03, _excerpt(retyped))[0]


def test_a_common_line_no_longer_matches_anywhere(tmp_path):
    """`return ran` and `def step` both exist, but not one after the other."""
    text = _excerpt(STEP + "        return ran\n")
    assert "the file has" in _check(tmp_path, STAGE03, text)[0]
    assert _check(tmp_path, STAGE03, _excerpt(STEP + "    ...\n        return ran\n")) == []


def test_an_excerpt_of_a_missing_file_or_without_a_header(tmp_path):
    missing = "```\n# roseinfer/session.py\nx = 1\n```\n"  # no session.py before stage 03
    assert "does not exist at stage 02-kv-cache" in _check(tmp_path, "02-kv-cache", missing)[0]
    plain = "```python\nfrom roseinfer import LLM\n```\n"  # no header: not an excerpt
    assert _check(tmp_path, STAGE03, plain) == []


def test_a_diff_excerpt_reads_minus_lines_at_the_previous_stage(tmp_path):
    diff = (
        "```diff\n# roseinfer/session.py\n@@ append_token @@\n"
        "         self.output_ids.append(token_id)\n"
        "-        self.last_delta = self.detokenizer.step(token_id)\n"
        "+        self.last_delta = self.detokenizer.step(token_id)\n```\n"
    )
    assert _check(tmp_path, "04-kv-block-manager", diff) == []  # session.py is new in stage 03
    (failure,) = _check(tmp_path, STAGE03, diff)  # stage 02 has no session.py
    assert "session.py does not exist at the previous stage" in failure
    swapped = diff.replace("-        self.last", "+        self.XXX").replace(
        "+        self.last", "-        self.last"
    )
    assert _check(tmp_path, "04-kv-block-manager", swapped)


def test_a_block_inside_a_list_item_is_read_without_its_indentation(tmp_path):
    diff = (
        "1. A step:\n\n   ```diff\n   # roseinfer/session.py\n"
        "   -        self.last_delta = self.detokenizer.step(token_id)\n"
        "   +        self.last_delta = self.detokenizer.step(token_id)\n   ```\n"
    )
    assert _check(tmp_path, "04-kv-block-manager", diff) == []


def test_a_chapter_without_a_stage_commit_is_checked_against_the_working_tree(tmp_path):
    text = "```python\n# roseinfer/config.py\n" + (REPO / "roseinfer/config.py").read_text().splitlines()[0] + "\n```\n"
    assert _check(tmp_path, "99-not-yet-written", text) == []


def test_test_names_are_checked_at_the_stage(tmp_path):
    ok = "`test_scheduler_steps_round_robin` and `tests/test_03_offline_scheduler.py` and `TestForkMachine`.\n"
    assert _check(tmp_path, "11-fork-and-beam-search", ok) == []
    assert "no test `test_made_up`" in _check(tmp_path, STAGE03, "See `test_made_up`.\n")[0]
    later = "`test_n8_uses_fewer_blocks_than_8_separate_requests` is stage 11's.\n"
    assert _check(tmp_path, STAGE03, later)
    assert _check(tmp_path, STAGE03, "In the main checkout, " + later) == []  # exists in the working tree


def test_parametrised_test_names_name_real_ids(tmp_path):
    stage = "09-one-forward-per-step"
    assert _check(tmp_path, stage, "`test_greedy_equals_hf_for_every_token_budget[7]`\n") == []
    assert _check(tmp_path, stage, "`test_greedy_equals_hf_for_every_token_budget[1|7|4096]`\n") == []
    assert _check(tmp_path, stage, "`test_greedy_equals_hf_for_every_token_budget[...]`\n") == []
    assert _check(tmp_path, stage, "`test_greedy_equals_hf_for_every_token_budget[8]`\n")
    assert _check(tmp_path, stage, "`test_a_full_hit_still_computes_the_last_token[1]`\n")  # not parametrised


def test_commands_and_the_run_box_are_checked_at_the_stage(tmp_path):
    box = (
        "## Run this chapter\n\n```bash\n./scripts/tag_stages.sh\n"
        "git worktree add ../roseinfer-03 stage-03-offline-scheduler\n"
        "./scripts/share_venv.sh ../roseinfer-03\ncd ../roseinfer-03 && ./offline_example.sh\n```\n"
    )
    assert _check(tmp_path, STAGE03, box) == []
    wrong_tag = box.replace("add ../roseinfer-03 stage-03-offline-scheduler", "add ../roseinfer-03 stage-02-kv-cache")
    assert "checks out stage-03-offline-scheduler" in _check(tmp_path, STAGE03, wrong_tag)[0]
    later_script = box.replace("./offline_example.sh", "./swap_example.sh")  # stage 12's
    assert "`./swap_example.sh` does not exist at stage 03" in _check(tmp_path, STAGE03, later_script)[0]
    assert "no stage is called" in _check(tmp_path, STAGE03, "`stage-04-kv-cache`\n")[0]
    k = "```bash\n./scripts/test.sh -k round_robin\n./scripts/test.sh -k no_such_words\n```\n"
    (failure,) = _check(tmp_path, STAGE03, k)
    assert "`-k no_such_words` matches no test" in failure
    local = "```bash\n.venv/bin/python /tmp/x/scripts/benchmark.py\n```\n"
    assert "a path of one machine" in _check(tmp_path, STAGE03, local)[0]


def test_local_paths_and_output_marks(tmp_path):
    assert "a path of one machine" in _check(tmp_path, STAGE03, "Run /home/me/roseinfer/x.\n")[0]
    assert "temporary path" in _check(tmp_path, STAGE03, "```\nwrote /tmp/abc/x.png\n```\n")[0]
    shown = (
        "```bash\n./offline_example.sh   # four prompts\n```\n\n<!-- output: ./offline_example.sh -->\n```\nx\n```\n"
    )
    assert _check(tmp_path, STAGE03, shown) == []
    unshown = shown.replace("<!-- output: ./offline_example.sh", "<!-- output: ./offline_example.sh --seed 3")
    assert "not shown above the output" in _check(tmp_path, STAGE03, unshown)[0]


def test_the_readme_layout_lists_every_module():
    readme = read_document(REPO / "README.md")
    from tools.chapters.words import check_layout

    assert check_layout(readme) == []
    block = next(b for b in readme.blocks if b.lines[:1] == ["roseinfer/"])
    block.lines = [line for line in block.lines if "block_pool.py" not in line]
    assert "does not list roseinfer/core/block_pool.py" in check_layout(readme)[0]


def test_outputs_are_compared_after_normalising_what_varies():
    block = Block(10, "", ["$ ./x.sh", "wrote ./roseinfer/a.png", "[64 tokens in 0.24s, 271.5 tokens/s]", "...", "end"])
    out = "wrote /tmp/r/roseinfer-01/roseinfer/a.png\n\r50%|##  |\r100%|####|\n"  # a progress bar is not output
    out += "[64 tokens in 1.5s, 42.0 tokens/s]\nx\nend\n"
    assert chapter_outputs.compare(block, out, {"/tmp/r/roseinfer-01": "."}) is None
    assert chapter_outputs.compare(block, out.replace("64 tokens", "65 tokens"), {"/tmp/r/roseinfer-01": "."})
    assert chapter_outputs.compare(block, out + "more\n", {"/tmp/r/roseinfer-01": "."})  # the block ends at `end`
    timed = Block(1, "", ["request TTFT ms", "q0 16.5"], timed=True)
    assert chapter_outputs.compare(timed, "request TTFT ms\nq0 9.75\n", {}) is None
    assert chapter_outputs.compare(timed, "request TTFT ms\nq1 9.75\n", {})


@pytest.mark.skipif(not os.environ.get("ROSEINFER_CHECK_OUTPUTS"), reason="slow: set ROSEINFER_CHECK_OUTPUTS=1")
def test_marked_outputs_are_what_the_stage_prints():
    proc = subprocess.run(
        [sys.executable, "scripts/check_chapters.py", "--outputs", "04"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 marked outputs rerun, 0 differ" in proc.stdout


def test_a_chapter_links_its_neighbours_and_shows_its_diff(tmp_path):
    from tools.chapters.links import check_links

    chapter = tmp_path / "05-b" / "README.md"
    chapter.parent.mkdir()
    good = (
        "Previous: [04](../04-a/README.md) ·\nNext: [06](../06-c/README.md)\n\n"
        "```bash\ngit diff -M stage-04-a stage-05-b --stat -- roseinfer/\n```\n"
    )
    chapter.write_text(good)
    assert check_links(read_document(chapter), "05-b", ("04-a", "06-c")) == []
    assert check_links(read_document(chapter), "05-b", ("04-a", None)) == []  # the last chapter links no next
    chapter.write_text(good.replace("Next: [06](../06-c/README.md)", "Next: chapter 06"))
    (failure,) = check_links(read_document(chapter), "05-b", ("04-a", "06-c"))
    assert "no 'Next: [...](../06-c/README.md)' link" in failure
    chapter.write_text(good.replace("stage-04-a stage-05-b", "stage-03-z stage-05-b"))
    (failure,) = check_links(read_document(chapter), "05-b", ("04-a", "06-c"))
    assert "git diff stage-04-a stage-05-b" in failure


GOOD_ORDER = [
    "1. The problem",
    "2. The idea",
    "3. Walkthrough of the diff",
    "4. Memory layout",  # more about the code: allowed between the walkthrough and Run it
    "5. Run it",
    "6. Check yourself",
    "7. Exercises",
    "8. Build it yourself",
    "9. What the next stage fixes",
    "10. Measured: naive vs KV cache",
]


def _sections(tmp_path, titles: list[str], body: str = "text\n") -> list[str]:
    from tools.chapters.sections import check_sections

    chapter = tmp_path / "05-b" / "README.md"
    chapter.parent.mkdir(exist_ok=True)
    chapter.write_text("# 05 · B\n\n## Run this chapter\n\n" + "".join(f"## {t}\n\n{body}\n" for t in titles))
    return check_sections(read_document(chapter), "05-b", in_book=True)


def test_a_chapter_has_its_sections_in_the_readers_order(tmp_path):
    assert _sections(tmp_path, GOOD_ORDER) == []
    without_next = [t for t in GOOD_ORDER if "next stage" not in t]  # optional, as in the last chapter
    assert _sections(tmp_path, [f"{i}. {t.split('. ', 1)[1]}" for i, t in enumerate(without_next, 1)]) == []


def test_measured_in_the_middle_fails_and_is_the_section_named(tmp_path):
    titles = [t.split(". ", 1)[1] for t in GOOD_ORDER]
    titles.insert(5, titles.pop())  # Measured right after Run it, as chapters 01-20 had it
    (failure,) = _sections(tmp_path, [f"{i}. {t}" for i, t in enumerate(titles, 1)])
    assert "05-b/README.md:" in failure and "section '6. Measured: naive vs KV cache'" in failure
    assert "out of order" in failure and failure.endswith("[What the next stage fixes], Measured")


def test_a_gap_in_the_numbers_fails(tmp_path):
    titles = GOOD_ORDER[:4] + [f"{int(t.split('.')[0]) + 1}.{t.split('.', 1)[1]}" for t in GOOD_ORDER[4:]]
    (failure,) = _sections(tmp_path, titles)  # one failure: the first section after the gap
    assert "section '6. Run it' is numbered 6, expected 5" in failure


def test_missing_misplaced_and_misnumbered_sections_fail(tmp_path):
    failures = _sections(tmp_path, [t for t in GOOD_ORDER if "Check" not in t])
    assert any("no 'Check yourself' section" in f for f in failures)
    early = _sections(tmp_path, ["1. The problem", "2. Memory layout", "3. The idea"])  # before the walkthrough
    assert any("'2. Memory layout' (a section about the code) is out of order" in f for f in early)
    moved = _sections(tmp_path, GOOD_ORDER[:-1] + ["10. Measured\n\n### 5.1 Throughput\n\n### 10.2 Memory"])
    assert [f.split(": ", 1)[1] for f in moved] == ["subsection '5.1 Throughput' should be numbered 10.1"]


def _gpu_claims(tmp_path, text: str) -> list[str]:
    from tools.chapters.gpu_claims import check_gpu_claims

    chapter = tmp_path / "README.md"
    chapter.write_text(text)
    return check_gpu_claims(read_document(chapter))


@pytest.mark.parametrize(
    "claim",
    [
        "The decode step replays CUDA graphs.",
        "The attention kernel runs on the GPU.",
        "On an H100 it takes 7.5 µs.",
        "The kernel reaches 2.9 TB/s on an H100.",
        "Split-K is faster on a GPU.",
        "On CUDA the copies are asynchronous.",
        "- **Inside a node**: the decode step goes from 4.0 ms to 1.21 ms on 8 GPUs (3.3×).",
    ],
)
def test_a_gpu_result_stated_as_fact_fails(tmp_path, claim):
    (failure,) = _gpu_claims(tmp_path, f"Some text first.\n\n{claim}\n")
    assert "README.md:3: a GPU result stated as fact" in failure and claim.split()[1] in failure


@pytest.mark.parametrize(
    "framed",
    [
        "The decode step is written to replay CUDA graphs, and has never run on a GPU.",
        "On an H100 it would take 7.5 µs.",
        "On paper, the kernel reaches 2.9 TB/s on an H100.",
        "The kernel runs on the GPU. It is tested in Triton's interpreter; a GPU has not run it.",  # the paragraph
        "> Never run on a GPU: the kernel runs on the GPU at 80 µs, a bound from the bytes it reads.",  # a banner
        "### The GPU path (never run on a GPU)\n\nOn CUDA, `Int8Linear` runs two Triton kernels.",  # its heading
        "A kernel launch on a GPU costs time; `kernel[grid]` runs one copy per grid point (a block on a GPU).",
    ],
)
def test_a_framed_gpu_sentence_passes(tmp_path, framed):
    assert _gpu_claims(tmp_path, framed + "\n") == []


def test_gpu_claims_in_code_are_not_prose(tmp_path):
    code = "```bash\nPYTHON=python3 ./verify_paged_attention.sh   # runs on the GPU: 80 µs on an H100\n```\n"
    assert _gpu_claims(tmp_path, code + "The `runs on the GPU` span is code too.\n") == []
    memory_bound = "Decode is memory-bound, and it runs on the GPU.\n"  # "memory-bound" is not a bound on a number
    assert _gpu_claims(tmp_path, memory_bound)


def test_a_long_chapter_fails_and_a_long_measured_section_names_where_the_long_form_goes(tmp_path):
    from tools.chapters.length import MEASURED_MAX, READING_MAX, check_length, count

    chapter = tmp_path / "07-p" / "README.md"
    chapter.parent.mkdir()
    head = "# 07 · P\n\n## Run this chapter\n\nread me\n\n"
    chapter.write_text(head + "## 9. Measured\n\n" + "word " * (MEASURED_MAX - 3) + "\n")
    assert count(chapter).reading == 10 and count(chapter).measured == MEASURED_MAX
    assert check_length(chapter) == []
    chapter.write_text(head + "## 9. Measured\n\n" + "word " * (MEASURED_MAX + 1) + "\n")
    (failure,) = check_length(chapter)
    assert f"README.md:7: Measured has {MEASURED_MAX + 4} words" in failure and "results/07-p/README.md" in failure
    chapter.write_text(head + "word " * (READING_MAX - 10) + "\n## 9. Measured\n")
    assert count(chapter).reading == READING_MAX and check_length(chapter) == []
    chapter.write_text(head + "word " * (READING_MAX - 9) + "\n## 9. Measured\n")
    (failure,) = check_length(chapter)
    assert f"README.md:1: the reading part (before Measured) has {READING_MAX + 1} words" in failure


def test_the_readme_reading_times_are_the_counted_ones(tmp_path):
    from tools.chapters.length import Length, check_readme, summary

    lengths = [Length(f"{n:02d}-x", words, 0, 0) for n, words in [(1, 2400), (2, 3000), (4, 4100), (8, 3600)]]
    want = summary(lengths)
    assert (want["shortest words"], want["longest words"], want["shortest minutes"], want["longest minutes"]) == (
        2400,
        4100,
        12,
        21,
    )
    assert (want["core hours"], want["all hours"], want["chapters"]) == (0.5, 1.0, 4)
    readme = tmp_path / "README.md"
    good = (
        "intro\n\n**How long it takes.** A chapter's reading part is 2,400 to 4,100 words (counted): 12 to 21\n"
        "minutes at 200 words a minute. The core path below is about 0.5 hours of reading, all 4 chapters about 1.0.\n"
    )
    readme.write_text(good)
    assert check_readme(readme, lengths) == []
    readme.write_text(good.replace("4,100 words", "4,000 words").replace("about 1.0", "about 7"))
    failures = check_readme(readme, lengths)
    assert [f.split(": it says ")[1].split(",")[0] for f in failures] == ["longest words 4000", "all hours 7"]
    assert all(f.startswith("README.md:3:") for f in failures)
    readme.write_text("no such sentence\n")
    assert 'no "How long it takes" sentence' in check_readme(readme, lengths)[0]
