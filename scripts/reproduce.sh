#!/usr/bin/env bash
# Regenerate every measured number and figure of every chapter, each with its own stage's code.
# For each stage, results/NN-slug/runs.toml lists the commands behind the chapter's numbers;
# tools/chapters/reproduce.py runs each in a worktree of the stage (repeated where the chapter gives
# medians), records its output in results/NN-slug/NAME.json, and copies the figures it draws
# into this checkout's chapters/. Then `git diff` shows what moved, and
# `python scripts/check_chapters.py --sync-data` copies the new outputs into the chapters.
# `--list` prints how long each run took when it was last recorded, and the sum: on 2 CPU cores the
# whole run takes hours (the peer comparisons of stages 17-19 most of it); one stage takes minutes.
#   ./scripts/reproduce.sh                  # every stage
#   ./scripts/reproduce.sh 04 07            # some stages
#   ./scripts/reproduce.sh 09 --only gpt2-t2
#   ./scripts/reproduce.sh --list           # the runs, their data files, and how long they took
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source scripts/setup.sh
./scripts/tag_stages.sh >/dev/null
exec "$VENV/bin/python" -m tools.chapters.reproduce "$@"
