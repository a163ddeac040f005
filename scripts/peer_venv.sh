# shellcheck shell=bash
# Sourced by scripts/setup_peer_*.sh: create a peer's virtualenv and put torch in it first (the local CPU
# wheel, so that nothing the peer installs afterwards pulls a CUDA build).
#
#   peer_venv_with_torch TAG VENV TORCH_REQUIREMENT
#
# PYTHON overrides the interpreter (default: python3.11, else python3).
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

peer_venv_with_torch() {
  local tag="$1" venv="$2" torch_req="$3" py
  py="${PYTHON:-$(command -v python3.11 || command -v python3)}"
  if [ ! -x "$venv/bin/python" ]; then
    echo "[$tag] creating $venv with $("$py" --version)" >&2
    "$py" -m venv "$venv"
  fi
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "[$tag] installing $torch_req (first, so nothing pulls a CUDA build)" >&2
    "$venv/bin/python" -m pip install -q "$torch_req"
  fi
}
