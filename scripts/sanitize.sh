#!/usr/bin/env bash
# Builds the native core with AddressSanitizer + UndefinedBehaviorSanitizer and runs the engine
# tests against that build (the installed optimized build is left alone).
set -euo pipefail
cd "$(dirname "$0")/.."
build=build/sanitize
cmake -S . -B "$build" -DAGENTACCEL_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug \
  -DPython_EXECUTABLE="$(command -v python3)" -Dnanobind_DIR="$(python3 -m nanobind --cmake_dir)" >/dev/null
cmake --build "$build" --target _core -j"$(nproc)" >/dev/null
core=$(ls "$build"/_core*.so)
runtime="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
# Python itself is not instrumented: leak checking would report the interpreter's own arenas.
LD_PRELOAD="$runtime" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  AGENTACCEL_CORE="$core" HYPOTHESIS_PROFILE=sanitize \
  python3 -m pytest -q -p no:cacheprovider tests/test_engine_oracle.py tests/test_engine_api.py tests/test_batch_drafter.py tests/test_step_budget.py tests/test_engine_fuzz.py \
  "tests/test_template_miner.py::test_native_lines_match_the_reference" "$@"
