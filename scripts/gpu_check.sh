#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py): random-weight Llama-2-7B- and Qwen2.5-7B-shaped models
# built on the GPU in bf16; extraction, head training (cached and online), scoring and calibrated decoding, each timed
# against the same step without the head. Runs from the source tree alone (no install, no network), within a time limit.
# transformers only: vLLM (docs/vllm.md) is not part of it, because the device machine has no network and takes 64 MiB
# of files from here, while vLLM's CUDA build and its dependencies are gigabytes; vLLM's own GPU run is for a machine
# that can `pip install 'ats[vllm]'`.
#
#   bash scripts/gpu_check.sh                                  # -> benchmarks/results/gpu_check.md and .json
#   bash scripts/gpu_check.sh --out "$OUT/gpu_check"           # results elsewhere (e.g. a device tool's $OUT)
#   bash scripts/gpu_check.sh --tiny --device cpu --out /tmp/gpu_check    # CPU smoke run, well under a minute
#
# Options after the script's name go to benchmarks/gpu_check.py (--help lists them). GPU_CHECK_LIMIT (seconds,
# default 480) bounds the whole run; the results files are rewritten after every step, so a run stopped by the limit
# keeps what it measured (exit status 124).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
exec timeout --kill-after=15 "${GPU_CHECK_LIMIT:-480}" "$PY" benchmarks/gpu_check.py "$@"
