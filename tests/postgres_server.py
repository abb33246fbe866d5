"""A real PostgreSQL server for the tests: `initdb` and `pg_ctl` from the machine's packages in a
temporary folder, listening on 127.0.0.1 only, trust authentication, stopped (immediate mode) at
teardown. Run as an unprivileged user when the tests run as root (initdb refuses root). When no
PostgreSQL binaries are found this raises, saying how to install them: tests that need PostgreSQL
fail rather than skip."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from agentaccel.processes import free_port

USER = "agentaccel"  # the database superuser initdb creates
INSTALL_HINT = ("PostgreSQL server binaries (initdb, pg_ctl) not found: install them with "
                "`apt-get install postgresql` (Debian/Ubuntu) or `brew install postgresql@15` (macOS), "
                "or put their folder on PATH")


def find_binaries() -> Path:
    """The folder holding initdb and pg_ctl: on PATH, else the Debian layout."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).parent
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(folder) / "initdb").exists() and (Path(folder) / "pg_ctl").exists():
            return Path(folder)
    raise RuntimeError(INSTALL_HINT)


class PostgresServer:
    def __init__(self, folder: Path) -> None:
        self.bin = find_binaries()
        self.folder = Path(folder)
        self.data = self.folder / "data"
        self.port = free_port()
        self._as_user: list[str] = []
        if os.geteuid() == 0:  # initdb refuses root: the server runs as nobody, in a folder it owns
            self._as_user = ["runuser", "-u", "nobody", "--"]
            self.folder.mkdir(parents=True, exist_ok=True)
            self.folder.parent.chmod(0o711)  # nobody passes through to its folder
            shutil.chown(self.folder, "nobody", "nogroup")
            self.folder.chmod(0o700)

    def _run(self, *args: str) -> None:
        done = subprocess.run([*self._as_user, *args], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")

    def start(self) -> PostgresServer:
        """Starts the server; the first start makes its data folder (a later one serves it again)."""
        if not self.data.exists():
            self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8",
                      "--no-sync", "--no-instructions")
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.folder} -c fsync=off "
                   "-c max_connections=200 -c shared_buffers=64MB")
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.folder / "log"), "-o", options,
                  "-w", "-t", "60", "start")
        return self

    def restart(self) -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.folder / "log"), "-m", "immediate",
                  "-w", "-t", "60", "restart")

    def stop(self) -> None:
        if self.data.exists():
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "-t", "60", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database on this server; its URL."""
        import psycopg

        name = "t" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)
