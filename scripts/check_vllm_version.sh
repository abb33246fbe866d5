#!/usr/bin/env bash
# Checks a vLLM release the machine cannot run (e.g. a CUDA build on a CPU machine) against what
# the plugin patches and reads (agentaccel/backends/vllm/compat.py): its wheel goes, without its
# dependencies, into a throwaway venv over this environment, and compat.problems() imports it.
#   scripts/check_vllm_version.sh 0.33.0
set -euo pipefail
version=${1:?usage: $0 VLLM_VERSION}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv --system-site-packages "$work/venv"
"$work/venv/bin/pip" install --quiet --no-deps "vllm==$version"
cd "$(dirname "$0")/.."
"$work/venv/bin/python" - "$version" <<'PY' 2>&1 | grep -v -E "^(INFO|WARNING|DEBUG)|vllm._C"
import sys

import vllm

from agentaccel.backends.vllm import compat

assert vllm.__version__ == sys.argv[1], vllm.__version__
found = compat.problems()
print(f"vLLM {vllm.__version__}: " + ("everything the plugin patches and reads is there" if not found else
                                      f"{len(found)} problem(s)"))
for p in found:
    print("  " + p)
sys.exit(1 if found else 0)
PY
