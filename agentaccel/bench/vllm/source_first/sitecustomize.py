"""Put on the PYTHONPATH of an agentaccel@LABEL server (bench vllm) with its release's folder after
it: that folder's agentaccel is imported, not this checkout's. PYTHONPATH alone is not enough where
agentaccel is installed editable: the editable install's import hook sits in `sys.meta_path`, which
Python asks before it searches the path. Python imports `sitecustomize` once at start-up, after
the installs' hooks are in place: here every hook that would give agentaccel from anywhere but
AGENTACCEL_SOURCE is taken out."""

import os
import sys

SOURCE = os.environ.get("AGENTACCEL_SOURCE", "")


def _elsewhere(finder) -> bool:
    """Whether `finder` would give agentaccel from outside SOURCE (the path's own finder gives it
    from SOURCE, the first folder on the path that holds it)."""
    try:
        spec = finder.find_spec("agentaccel", None)
    except Exception:  # a hook that cannot answer for this name: not the one to take out
        return False
    return spec is not None and not os.path.abspath(spec.origin or "").startswith(SOURCE + os.sep)


if SOURCE:
    sys.meta_path[:] = [f for f in sys.meta_path if not _elsewhere(f)]
