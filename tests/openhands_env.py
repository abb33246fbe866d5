"""A separate Python >= 3.12 environment with OpenHands in it, as users run OpenHands: never a
dependency of agentaccel, talking HTTP to the proxy. Built with uv (seconds), in a folder the
caller owns (a test's temporary folder), with uv's cache there too."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

SDK = ("openhands-sdk==1.58.*", "openhands-tools==1.58.*")


def python312() -> str | None:
    """A Python 3.12+ interpreter: on PATH, else one of pyenv's versions (whose shims answer only
    for the selected version)."""
    for name in ("python3.13", "python3.12"):
        found = shutil.which(name)
        if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
            return found
    root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates = sorted(glob.glob(f"{root}/versions/3.1[2-9]*/bin/python3"))
    return candidates[-1] if candidates else None


def build(folder: Path, packages=SDK) -> tuple[Path | None, str]:
    """(the environment's python, "") or (None, why it could not be built)."""
    interpreter = python312()
    if interpreter is None:
        return None, "no Python >= 3.12 interpreter on this machine"
    env = {**os.environ, "UV_CACHE_DIR": str(folder / "uv-cache")}
    venv = folder / "openhands"
    steps = ([sys.executable, "-m", "uv", "venv", "--python", interpreter, str(venv)],
             [sys.executable, "-m", "uv", "pip", "install", "--python", str(venv / "bin" / "python"), *packages])
    for cmd in steps:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"{' '.join(cmd[:4])}: {e}"
        if out.returncode != 0:
            return None, f"{' '.join(cmd[:4])}: {out.stderr.strip()[-500:]}"
    return venv / "bin" / "python", ""
