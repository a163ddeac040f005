#!/usr/bin/env bash
# Build it yourself: write the functions a stage teaches, graded by that stage's own tests.
#
#   ./scripts/exercise.sh 07 ~/ex07         ~/ex07: a git worktree of stage 07 in which the functions chapter 07
#                                           teaches raise NotImplementedError (the venv is this checkout's)
#   ./scripts/exercise.sh --check ~/ex07    the grader: stage 07's tests/test_07_*.py as git holds them at the
#                                           stage; each test, then "N/M tests pass; next stub to fill: ..."
#                                           (--quick: a fast subset, -x: stop at the first failure)
#   ./scripts/exercise.sh --restore ~/ex07  the stage's own code back in the stubs (--only NAME: one function)
#   ./scripts/exercise.sh --list            every stage's stubs
#   ./scripts/exercise.sh --prove [NN ...]  every stage (or these): the grader fails on the stubs and passes on
#                                           the stage's code (--per-stub: each stub alone fails it too; slow)
#
# The stubs of stage NN are listed in exercises/NN-slug.toml; tools/exercises/exercise.py does the work. When you
# are done with an exercise: git worktree remove --force ~/ex07
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
usage() { sed -n '3,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ "$#" -ge 1 ] || usage
source "$root/scripts/setup.sh"  # this checkout's .venv (created on the first run)
tool=("$VENV/bin/python" -m tools.exercises.exercise)  # PYTHONPATH: setup.sh puts $root on it

case "$1" in
  --check) shift; exec "${tool[@]}" check "$@" ;;
  --restore) shift; exec "${tool[@]}" restore "$@" ;;
  --list) exec "${tool[@]}" list ;;
  --prove) shift; exec "${tool[@]}" prove "$@" ;;
  -h | --help) usage ;;
  -*) echo "unknown option $1" >&2; usage ;;
esac

[ "$#" -ge 2 ] || usage
nn="$1" dir="$2"
shift 2
[[ "$nn" =~ ^[0-9]+$ ]] || { echo "NN must be a stage number, got $nn" >&2; exit 2; }
if [ -e "$dir" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ]; then
  echo "$dir exists and is not empty: give a new directory" >&2
  exit 2
fi
# the stage's commit, from the `Stage:` trailers (no tags needed); this also checks that it has a manifest
sha="$("${tool[@]}" commit "$nn")"
mkdir -p "$dir" && dir="$(cd "$dir" && pwd)"  # absolute: git runs in this checkout
git -C "$root" worktree add --quiet --detach "$dir" "$sha"
"$root/scripts/share_venv.sh" "$dir" >/dev/null
exec "${tool[@]}" new "$nn" "$dir" "$@"
