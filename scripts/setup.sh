# shellcheck shell=bash
# Create .venv and install roseinfer's dependencies, once. Sourced by ./generate.sh,
# ./scripts/test.sh and the other stage scripts; later runs only check a stamp file.
#
#   1. python3.11 -m venv .venv           (ROSEINFER_VENV overrides the location)
#   2. pip install torch==2.13.0          (first, and only if torch is missing)
#   3. pip install -r requirements.txt -c scripts/constraints.txt
#   4. pip install --no-deps -e .       (only into this checkout's own .venv)
#   5. apt-get install libtcmalloc-minimal4   (as root with apt, if missing: the server's allocator)
#
# The stamp file .venv/.roseinfer-setup lists the requirement lines that were installed
# (requirements.txt + constraints, comments dropped). Setup is skipped when every requirement of
# this checkout is in that list, so a checkout of an earlier stage, whose requirements are a
# subset of the latest stage's, reuses the same .venv (see scripts/share_venv.sh).
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROSEINFER_VENV:-$_root/.venv}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
_stamp_want="$(sed -e 's/#.*//' -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' -e '/^$/d' "$_root/requirements.txt" "$_root/scripts/constraints.txt" | LC_ALL=C sort -u)"
_stamp_have="$(LC_ALL=C sort -u "$VENV/.roseinfer-setup" 2>/dev/null || true)"
if [ ! -x "$VENV/bin/python" ] || [ -n "$(LC_ALL=C comm -23 <(echo "$_stamp_want") <(echo "$_stamp_have"))" ]; then
  _py="${PYTHON:-$(command -v python3.11 || command -v python3)}"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV with $("$_py" --version)" >&2
    "$_py" -m venv "$VENV"
  fi
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch==2.13.0 (first, so nothing pulls a CUDA build)" >&2
    "$VENV/bin/python" -m pip install -q torch==2.13.0
  fi
  echo "[setup] installing requirements.txt (constraint: torch==2.13.0)" >&2
  "$VENV/bin/python" -m pip install -q -r "$_root/requirements.txt" -c "$_root/scripts/constraints.txt"
  if [ "$VENV" = "$_root/.venv" ]; then  # `import roseinfer` anywhere means this checkout
    "$VENV/bin/python" -m pip install -q --no-deps -e "$_root"
  fi
  # tcmalloc for `roseinfer serve --allocator auto` (roseinfer/entrypoints/allocator.py), where we may install it
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal; then
    echo "[setup] installing libtcmalloc-minimal4 (a malloc that gives memory back, for the server)" >&2
    (apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1; }) \
      || echo "[setup] could not install libtcmalloc-minimal4: the server uses glibc's malloc" >&2
  fi
  echo "$_stamp_want" > "$VENV/.roseinfer-setup"
  echo "[setup] done" >&2
fi
# An editable install made before benchmarks/ and tools/ were packages maps only roseinfer: redo it once, so
# that `.venv/bin/python scripts/X.py` finds them from any folder (PYTHONPATH below covers the scripts anyway).
if [ "$VENV" = "$_root/.venv" ] && [ ! -e "$VENV/.roseinfer-shared" ] &&
  ! (cd / && env -u PYTHONPATH "$VENV/bin/python" -c "import benchmarks.common, tools.chapters" 2>/dev/null); then
  "$VENV/bin/python" -m pip install -q --no-deps -e "$_root" || echo "[setup] editable install failed" >&2
fi
# Scripts and tests import *this* checkout's roseinfer (also in a stage worktree).
export PYTHONPATH="$_root${PYTHONPATH:+:$PYTHONPATH}"
unset _root _stamp_want _stamp_have _py
