"""Running an agent's tools where they cannot change the machine: a private mount namespace in
which the whole filesystem is read-only except the folders the run owns, with empty tmpfs over
the host paths OpenHands' runtimes write to. Needs root and `unshare` (both where CI runs);
`available()` says whether this machine has them."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

AGENT_HOST_PATHS = ("/workspace", "/testbed", "/swe_util")


def available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c",
                            "mount -o remount,bind,ro / 2>/dev/null || mount -o remount,ro /"], capture_output=True)
    return probe.returncode == 0


def confined(command: Sequence[str], writable: Sequence[Path]) -> list[str]:
    """`command` in a private mount namespace: `writable` folders (which must exist) stay writable,
    every other path is read-only, and the agent host paths that exist are empty tmpfs."""
    script = [f"mount --bind {shlex.quote(str(p))} {shlex.quote(str(p))}" for p in writable]
    script.append("(mount -o remount,bind,ro / 2>/dev/null || mount -o remount,ro /)")
    script += [f"mount -t tmpfs none {p}" for p in AGENT_HOST_PATHS if Path(p).is_dir()]
    return ["unshare", "--mount", "--propagation", "private", "bash", "-c", " && ".join(script) + ' && exec "$@"',
            "_", *command]
