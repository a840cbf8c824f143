#!/usr/bin/env bash
# The test suite (CPU; GPU tests are skipped without a GPU). Extra arguments go to pytest.
# Without them, the plugin's in-process tests then also run against the Python code of the newer
# vLLM releases (scripts/vllm_releases.sh; MEGAMOE_VLLM_RELEASES="" skips that).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_venv.sh"
cd "$root"
"$MEGAMOE_PY" -m pytest -q -rs tests "$@"
if [ $# -eq 0 ] && [ "${MEGAMOE_WITH_VLLM:-1}" = "1" ]; then
  bash "$root/scripts/vllm_releases.sh"
fi
