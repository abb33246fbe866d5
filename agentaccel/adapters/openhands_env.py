"""OpenHands' own Python environment. OpenHands needs Python >= 3.12 and is never a dependency of
agentaccel: it runs in a separate virtual environment and talks HTTP to the proxy, as users run
it. `build` makes one with uv (seconds, given PyPI) in a folder the caller names."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

SDK = ("openhands-sdk==1.58.*", "openhands-tools==1.58.*")
SDK_MODULES = "openhands.sdk, openhands.tools"
CLASSIC = ("openhands-ai==0.62.0",)  # the classic core, which OpenHands' own SWE-Bench evaluation drives
CLASSIC_MODULES = "openhands.core.main"
APP = ("openhands-ai==1.11.0",)  # the 1.x web app (it pins its SDK, tools and agent server)
APP_MODULES = "openhands.app_server.config, openhands.agent_server, uvicorn"


def python312() -> str | None:
    """A Python 3.12+ interpreter, 3.12 first: on PATH, else one of pyenv's versions (whose shims
    answer only for the selected version). 3.12 is what OpenHands is released for; on 3.13 uv
    resolves the classic core (openhands-ai 0.62) to its source distribution and builds it (a
    hundred seconds against twenty here)."""
    for name in ("python3.12", "python3.13", "python3.14"):
        found = shutil.which(name)
        if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
            return found
    root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    found = glob.glob(f"{root}/versions/3.1[2-9]*/bin/python3")
    # the lowest minor version, its newest release
    return max(found, key=lambda p: (-_version(p)[0], _version(p)[1]), default=None)


def _version(python: str) -> tuple[int, int]:
    """pyenv's <root>/versions/3.12.1/bin/python3 -> (12, 1): minor and release, the digits each
    part starts with (3.13t -> (13, 0))."""
    parts = [re.match(r"\d*", part).group() for part in Path(python).parents[1].name.split(".")[1:3]]
    return tuple(int(x or 0) for x in (parts + ["0"])[:2])


def has_sdk(python: Path, modules: str = SDK_MODULES) -> bool:
    return python.is_file() and subprocess.run(
        [str(python), "-c", f"import {modules}"], capture_output=True,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}).returncode == 0


def build(folder: Path, packages=SDK, modules: str = SDK_MODULES) -> tuple[Path | None, str]:
    """(the environment's python, "") or (None, why it could not be built). Reuses an environment
    already there; uv's cache stays inside `folder`."""
    venv = folder / "openhands"
    python = venv / "bin" / "python"
    if has_sdk(python, modules):
        return python, ""
    interpreter = python312()
    if interpreter is None:
        return None, "no Python >= 3.12 interpreter on this machine"
    env = {**os.environ, "UV_CACHE_DIR": str(folder / "uv-cache")}
    steps = ([sys.executable, "-m", "uv", "venv", "--allow-existing", "--python", interpreter, str(venv)],
             [sys.executable, "-m", "uv", "pip", "install", "--python", str(python), *packages])
    for cmd in steps:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"{' '.join(cmd[:5])}: {e}"
        if out.returncode != 0:
            return None, f"{' '.join(cmd[:5])}: {out.stderr.strip()[-500:]}"
    return python, ""
