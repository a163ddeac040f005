#!/usr/bin/env bash
# Rebuild the stage-NN-slug tags from the `Stage: NN-slug` trailers in HEAD's history.
# Idempotent; works in a fresh clone (tags do not always travel, trailers do).
# If a stage appears twice, the newest commit wins.
set -euo pipefail
cd "$(dirname "$0")/.."
declare -A seen=()
while IFS=$'\t' read -r sha stages; do
  for stage in ${stages//,/ }; do
    [ -n "$stage" ] && [ -z "${seen[$stage]:-}" ] || continue
    seen[$stage]=1
    tag="stage-$stage"
    if [ "$(git rev-parse -q --verify "refs/tags/$tag^{commit}" || true)" = "$sha" ]; then
      echo "ok      $tag -> ${sha:0:10}"
    else
      git tag -f "$tag" "$sha" >/dev/null
      echo "tagged  $tag -> ${sha:0:10}"
    fi
  done
done < <(git log --format='%H%x09%(trailers:key=Stage,valueonly,separator=%x2C)' HEAD)
[ "${#seen[@]}" -gt 0 ] || echo "no Stage: trailers found"
