#!/usr/bin/env bash
# The test suite (CPU; GPU tests are skipped without a GPU). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_venv.sh"
cd "$root"
"$MEGAMOE_PY" -m pytest -q -rs tests "$@"
