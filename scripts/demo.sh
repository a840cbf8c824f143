#!/usr/bin/env bash
# The main job on its embedded default: a small random MoE layer run expert-parallel on 2 CPU
# ranks through the portable megamoe path, checked against the float reference.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_venv.sh"
"$MEGAMOE_PY" -m vllm_megamoe.cli demo "$@"
