import os

from hypothesis import settings

# CI explores a fixed set of examples (a red CI must be reproducible); locally they vary.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("sanitize", derandomize=True, print_blob=True, max_examples=60)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))

# litellm fetches a price list from the internet at import unless told not to (no network here).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def openhands_python(tmp_path_factory):
    """OpenHands' own environment (Python >= 3.12, built with uv in a temporary folder), shared by
    the tests that run a real OpenHands agent; skipped where none can be built."""
    from agentaccel.adapters import openhands_env

    python, why = openhands_env.build(tmp_path_factory.mktemp("openhands-env"))
    if python is None:
        pytest.skip(f"no OpenHands environment: {why}")
    return python
