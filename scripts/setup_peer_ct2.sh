#!/usr/bin/env bash
# Create .venv-ct2: CTranslate2, the `ct2` peer of scripts/benchmark.py. Once; a second run finds the stamp
# file and does nothing.
#
#   bash scripts/setup_peer_ct2.sh
#   python scripts/benchmark.py --workload tiny --engines roseinfer,ct2 --threads 1
#
#   1. python3.11 -m venv .venv-ct2         (CT2_VENV overrides the location, PYTHON the interpreter)
#   2. pip install torch==2.13.0             (first: the CPU wheel; the converter loads the checkpoint with it)
#   3. pip install ctranslate2==4.8.5 transformers   (constraint: torch==2.13.0)
#
# The runner converts a model directory once with `ct2-transformers-converter --model DIR --output_dir OUT`
# (OUT under .cache/ct2/, keyed by DIR's path) and runs benchmarks/peers/ct2.py. It does not set CT2_USE_MKL:
# on AMD CPUs CT2_USE_MKL=1 was 2.6x slower here.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CT2_VENV:-$ROOT/.venv-ct2}"
STAMP="$VENV/.peer-setup"
TORCH="torch==2.13.0"
CT2="ctranslate2==4.8.5"
WANT="$TORCH $CT2 transformers"
source "$ROOT/scripts/peer_venv.sh"

if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
  echo "[ct2] $VENV is set up ($WANT)" >&2
  exit 0
fi

peer_venv_with_torch ct2 "$VENV" "$TORCH"
pip=("$VENV/bin/python" -m pip install -q)
echo "[ct2] installing $CT2 and transformers (constraint: $TORCH)" >&2
"${pip[@]}" "$CT2" transformers -c <(echo "$TORCH")
"$VENV/bin/python" -c "import ctranslate2, torch, transformers; print('[ct2] ctranslate2', ctranslate2.__version__, \
'| torch', torch.__version__, '| transformers', transformers.__version__)" >&2
echo "$WANT" > "$STAMP"
echo "[ct2] done" >&2
