#!/usr/bin/env bash
# Check a vLLM release other than the installed one against the internals ats uses (ats.integrations.vllm.surface),
# without a GPU: its wheel from PyPI (no dependencies) goes into a venv that sees this environment's packages (torch,
# transformers, ats), and vLLM is imported as a CPU platform. Reading only: nothing runs a model.
#
#   bash scripts/vllm_surface.sh 0.34.0            # -> benchmarks/results/vllm_surface/0.34.0.txt
#
# Exit status: the check's (0: every internal where ats expects it).
set -euo pipefail
version=${1:?usage: scripts/vllm_surface.sh VLLM_VERSION}
cd "$(dirname "$0")/.."
root=$(pwd)
venv=${VLLM_SURFACE_VENVS:-$HOME/.cache/ats/vllm-surface}/$version
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$venv"
  "$venv/bin/pip" install -q --no-deps "vllm==$version"
fi
mkdir -p benchmarks/results/vllm_surface
out=benchmarks/results/vllm_surface/$version.txt
cd /tmp  # not the source tree: the venv's vLLM, not a vllm folder nearby
set +e
VLLM_TARGET_DEVICE=cpu PYTHONPATH="$root/src" "$venv/bin/python" -m ats.integrations.vllm.surface 2>/dev/null \
  > "$root/$out.partial"
status=$?
set -e
mv "$root/$out.partial" "$root/$out"
cat "$root/$out"
exit $status
