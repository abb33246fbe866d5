"""A few thousand random engine operations against the reference oracle (tests/engine_fuzz.py;
the long run is `python3 tests/engine_fuzz.py --ops 1000000`, or this test with
AGENTACCEL_FUZZ_OPS=1000000 under scripts/sanitize.sh)."""

import os

import pytest
from engine_fuzz import run


@pytest.mark.parametrize("seed", [0, 1000, 2000])
def test_random_operations_match_the_reference(seed, tmp_path):
    ops = int(os.environ.get("AGENTACCEL_FUZZ_OPS", 1500))
    done = run(ops, seed, tmp_path)
    assert sum(done.values()) == ops and done["paper"] > 0 and done["finish"] > 0
