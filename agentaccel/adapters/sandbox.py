"""Running an agent's tools where they cannot change the machine: a private mount namespace in
which the whole filesystem is read-only except the folders the run owns, /tmp is an empty tmpfs
of its own (OpenHands' runtimes write fixed names there), and so are the host paths those runtimes
write to. Needs root and `unshare` (both where CI runs); `available()` says whether this machine
has them."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

AGENT_HOST_PATHS = ("/workspace", "/testbed", "/swe_util")
HOLD = "/mnt"  # an existing folder where /tmp is held while a fresh one is put over it (in the namespace only)
_READ_ONLY = "(mount -o remount,bind,ro / 2>/dev/null || mount -o remount,ro /)"


def available() -> bool:
    if shutil.which("unshare") is None or not Path(HOLD).is_dir():
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", _READ_ONLY],
                           capture_output=True)
    return probe.returncode == 0


def confined(command: Sequence[str], writable: Sequence[Path], readable: Sequence[Path] = ()) -> list[str]:
    """`command` in a private mount namespace: `writable` folders (which must exist) stay writable
    at their paths, /tmp is empty and private but for `writable` and `readable` folders under it
    (the latter read-only), every other path is read-only, and the agent host paths that exist
    are empty tmpfs."""
    script = [f"mount --bind /tmp {HOLD}", "mount -t tmpfs none /tmp"]
    for folder, mode in [*((Path(p), "rw") for p in writable), *((Path(p), "ro") for p in readable)]:
        q = shlex.quote(str(folder))
        if folder.is_relative_to("/tmp"):  # bring it back from where /tmp is held
            script += [f"mkdir -p {q}", f"mount --bind {shlex.quote(HOLD + str(folder)[len('/tmp'):])} {q}"]
            if mode == "ro":
                script.append(f"mount -o remount,bind,ro {q}")
        elif mode == "rw":
            script.append(f"mount --bind {q} {q}")
    script += [f"umount -l {HOLD}", _READ_ONLY]
    script += [f"mount -t tmpfs none {p}" for p in AGENT_HOST_PATHS if Path(p).is_dir()]
    return ["unshare", "--mount", "--propagation", "private", "bash", "-c", " && ".join(script) + ' && exec "$@"',
            "_", *command]
