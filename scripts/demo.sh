#!/usr/bin/env bash
# The main job on its embedded default: writes a tiny random MoE checkpoint (Qwen3-MoE style, no
# downloads), generates text greedily through vLLM with its default MoE backend and with
# --moe-backend megamoe, and prints both side by side: `vllm-megamoe demo`, to which the arguments
# go (--arch mixtral, --ep for expert parallelism over 2 ranks, --layer-only for one layer on CPU
# ranks without vLLM; `bash scripts/demo.sh --help` lists them with their defaults).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_venv.sh"
"$MEGAMOE_PY" -m vllm_megamoe.cli demo "$@"
