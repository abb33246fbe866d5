"""Running an agent's tools where they cannot change the machine: a private mount namespace in
which the whole filesystem is read-only except the folders the run owns, /tmp is an empty tmpfs
of its own (OpenHands' runtimes write fixed names there), and so are the host paths those runtimes
write to; a PID namespace of its own, so that nothing the agent starts (a runtime's servers, a
Jupyter kernel, tmux's daemon) outlives it; and, when asked, a network namespace of its own
whose only interface is loopback, where one port leads to the proxy through a Unix socket
(adapters/relay.py): OpenHands' runtime binds its servers to 0.0.0.0 with no setting to change
that, and in there 0.0.0.0 is reachable from nowhere else. Needs root, `unshare` and `ip` (all
where CI runs); `available()` says whether this machine has them."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

AGENT_HOST_PATHS = ("/workspace", "/testbed", "/swe_util")
HOLD = "/mnt"  # an existing folder where /tmp is held while a fresh one is put over it (in the namespace only)
_READ_ONLY = "(mount -o remount,bind,ro / 2>/dev/null || mount -o remount,ro /)"


NAMESPACES = ["--mount", "--propagation", "private", "--pid", "--fork", "--kill-child", "--mount-proc"]


def available() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None or not Path(HOLD).is_dir():
        return False
    probe = subprocess.run(["unshare", *NAMESPACES, "--net", "bash", "-c", f"ip link set lo up && {_READ_ONLY}"],
                           capture_output=True)
    return probe.returncode == 0


def confined(command: Sequence[str], writable: Sequence[Path], readable: Sequence[Path] = (),
             reach: tuple[int, Path] | None = None, loopback_names: Sequence[str] = ()) -> list[str]:
    """`command` in a private mount namespace: `writable` folders (which must exist) stay writable
    at their paths, /tmp is empty and private but for `writable` and `readable` folders under it
    (the latter read-only), every other path is read-only, and the agent host paths that exist
    are empty tmpfs; in a PID namespace of its own, torn down with everything in it when the
    command ends. `reach` = (port, socket): also in a network namespace of its own, loopback
    only, where 127.0.0.1:port leads to that Unix socket (served outside by
    `relay.unix_to_tcp(socket, port)`; the socket's folder must be writable). `loopback_names`
    (with `reach` only): host names that resolve to 127.0.0.1 in there, as a container's
    `--add-host NAME:host-gateway` makes them reach the host."""
    script = []
    if loopback_names and reach is None:
        raise ValueError("loopback_names needs a network namespace of its own (reach)")
    if reach is not None:
        port, socket = reach
        relay = Path(socket).parent / "relay.py"  # by path: a checkout under /tmp is hidden in here
        shutil.copy(Path(__file__).with_name("relay.py"), relay)
        script += ["ip link set lo up", shlex.join([sys.executable, str(relay), "tcp-to-unix", str(port), str(socket)])]
        if loopback_names:
            hosts = Path(socket).parent / "hosts"
            hosts.write_text(Path("/etc/hosts").read_text() + "".join(f"127.0.0.1 {n}\n" for n in loopback_names))
            script.append(f"mount --bind {shlex.quote(str(hosts))} /etc/hosts")
    script += [f"mount --bind /tmp {HOLD}", "mount -t tmpfs none /tmp"]
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
    # bash stays the namespace's first process (it reaps what the command orphans); when it ends,
    # the kernel ends everything else in the namespace
    return ["unshare", *NAMESPACES, *(["--net"] if reach is not None else []), "bash", "-c",
            " && ".join(script) + ' && "$@"', "_", *command]
