#!/usr/bin/env bash
# Let a checkout of an earlier stage use this checkout's .venv, so no stage installs anything:
#   ./scripts/tag_stages.sh
#   git worktree add ../roseinfer-03 stage-03-offline-scheduler
#   ./scripts/share_venv.sh ../roseinfer-03
#   cd ../roseinfer-03 && ./offline_example.sh
#
# It makes DIR/.venv a thin venv with no packages of its own: a .pth file puts DIR itself on
# the import path (so `import roseinfer` is DIR's roseinfer, with or without DIR's scripts) and then
# this checkout's .venv site-packages; the tools (ruff, pytest, jupyter) are linked; and the
# setup stamp is the one DIR's own scripts/setup.sh expects, so DIR's scripts find everything
# installed and skip their setup. No network is needed once this checkout's .venv exists.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[ "$#" = 1 ] || { echo "usage: $0 DIR   (a git worktree of a stage tag)" >&2; exit 2; }
dir="$(cd "$1" && pwd)"
[ -f "$dir/scripts/setup.sh" ] || { echo "$dir is not a roseinfer checkout" >&2; exit 2; }
[ "$dir" != "$root" ] || { echo "$dir is this checkout" >&2; exit 2; }
cd "$root"
source scripts/setup.sh  # this checkout's .venv: created on the first run, then only checked
shared="$VENV"
if [ -e "$dir/.venv" ] && [ ! -e "$dir/.venv/.roseinfer-shared" ]; then
  echo "$dir/.venv exists and is a venv of its own; remove it first to share $shared" >&2
  exit 2
fi

# Every requirement of DIR must be installed here (stages only ever add requirements).
reqs() { sed -e 's/#.*//' -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' -e '/^$/d' "$@" | LC_ALL=C sort -u; }
missing="$(LC_ALL=C comm -23 <(reqs "$dir/requirements.txt" "$dir/scripts/constraints.txt") <(LC_ALL=C sort -u "$shared/.roseinfer-setup"))"
[ -z "$missing" ] || { echo "$shared lacks requirements of $dir: $missing" >&2; exit 1; }

rm -rf "$dir/.venv"
"$shared/bin/python" -m venv --without-pip "$dir/.venv"
site_here="$("$dir/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
site_shared="$("$shared/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
printf '%s\nimport site; site.addsitedir(%s)\n' "$dir" "'$site_shared'" >"$site_here/roseinfer-shared.pth"
for tool in "$shared"/bin/*; do
  name="$(basename "$tool")"
  case "$name" in python* | activate* | Activate* | pip*) continue ;; esac
  ln -s "$tool" "$dir/.venv/bin/$name"
done
echo "$shared" >"$dir/.venv/.roseinfer-shared"
# The stamp in the words of DIR's own setup.sh: its `_stamp_want=` line, evaluated for DIR.
stamp_line="$(grep -m1 '^_stamp_want=' "$dir/scripts/setup.sh")"
(_root="$dir" && eval "$stamp_line" && printf '%s\n' "$_stamp_want" >"$dir/.venv/.roseinfer-setup")
echo "$dir/.venv now uses $shared"
