#!/usr/bin/env bash
# Check tagged stages: for each stage-NN-* tag (all, or only the NN given), check the
# snapshot out into a temporary worktree and run *that snapshot's* test command and its
# stage script (the `./*.sh` named in its README stage-table row).
#   ./scripts/check_stages.sh          # every stage
#   ./scripts/check_stages.sh 01 03    # just these
# Every worktree shares this checkout's .venv through scripts/share_venv.sh, so nothing is
# installed and no network is needed once this checkout's .venv exists.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
./scripts/tag_stages.sh >/dev/null
mapfile -t tags < <(git tag --list 'stage-*' | sort)
[ "${#tags[@]}" -gt 0 ] || { echo "no stage tags"; exit 1; }
failed=()
for tag in "${tags[@]}"; do
  nn="${tag#stage-}"; nn="${nn%%-*}"
  if [ "$#" -gt 0 ] && [[ ! " $* " =~ " $nn " ]]; then continue; fi
  dir="$(mktemp -d "/tmp/roseinfer-$tag.XXXX")"
  git worktree add --quiet --detach "$dir" "$tag"
  echo "=== $tag ($(git rev-parse --short "$tag")) in $dir"
  script="$(grep -E "^\| *$nn " "$dir/README.md" | grep -oE '`\./[A-Za-z0-9_./-]+\.sh' | head -1 | tr -d '`' || true)"
  ok=1
  ./scripts/share_venv.sh "$dir" || ok=0
  # the stage's own scripts, with its own .venv (the shared one), not a ROSEINFER_VENV from here
  if [ "$ok" = 1 ]; then
    (cd "$dir" && env -u ROSEINFER_VENV ./scripts/test.sh -q -x) || ok=0
  fi
  if [ "$ok" = 1 ] && [ -n "$script" ]; then
    echo "--- $script"
    (cd "$dir" && env -u ROSEINFER_VENV "$script") || ok=0
  fi
  git worktree remove --force "$dir"
  if [ "$ok" = 1 ]; then echo "=== $tag: OK"; else echo "=== $tag: FAILED"; failed+=("$tag"); fi
done
[ "${#failed[@]}" -eq 0 ] || { echo "failed: ${failed[*]}"; exit 1; }
