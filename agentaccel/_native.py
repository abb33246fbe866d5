"""Loads the native core. AGENTACCEL_CORE may name another build of it (CI points it at the
ASan+UBSan build to run the same tests against it)."""

from __future__ import annotations

import importlib.util
import os
import sys


def load_core():
    path = os.environ.get("AGENTACCEL_CORE")
    if not path:
        from agentaccel import _core

        return _core
    if "agentaccel._core" in sys.modules:
        return sys.modules["agentaccel._core"]
    spec = importlib.util.spec_from_file_location("agentaccel._core", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"AGENTACCEL_CORE={path}: not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    sys.modules["agentaccel._core"] = module
    spec.loader.exec_module(module)
    return module
