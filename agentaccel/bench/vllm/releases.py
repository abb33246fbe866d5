"""Another release's agentaccel beside this one in `bench vllm` (the method agentaccel@LABEL, its
folder named by --source LABEL=PATH): the trees of two commits side by side on the same calls.

The folder holds an installed agentaccel (`pip install --no-deps --target PATH <checkout>`: its
package and its built native core). Its server imports agentaccel from there, ahead of this one:
vLLM loads the plugin by its entry point's module name, so the folder goes first on the path, and
source_first/sitecustomize.py takes an editable install's import hook (which Python asks before
the path) out of its way. It is told only the settings that differ from the defaults
(PluginSettings.environ), which an earlier release reads as long as it knows them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from agentaccel.traces.store import SCHEMA_VERSION

SOURCED = "agentaccel@"  # agentaccel@LABEL: the agentaccel method, its plugin from another folder
SOURCE_FIRST = Path(__file__).parent / "source_first"  # its sitecustomize puts that folder's agentaccel first


@dataclass(frozen=True)
class Release:
    """The agentaccel an agentaccel@LABEL server imports: its folder and the trace store schema it
    reads (its store is handed to it in that schema: history.store_for)."""

    folder: Path
    schema: int

    @property
    def recorded(self) -> bool:
        """Whether its server's calls can be recorded into its store: this release's recorder brings a
        store to this schema, which a release reading another one then refuses."""
        return self.schema == SCHEMA_VERSION

    @classmethod
    def at(cls, folder: Path) -> Release:
        """The release installed in `folder` (ValueError saying why it cannot serve)."""
        if problem := plugin_source(folder):
            raise ValueError(problem)
        probe = "from agentaccel.traces.store import SCHEMA_VERSION; print(SCHEMA_VERSION)"
        env = {**os.environ, **source_env(folder)}
        # (in the folder: `-c` puts the working directory first on the path)
        r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120,
                           cwd=folder)
        if r.returncode != 0 or not r.stdout.strip().isdigit():
            last = (r.stderr.strip().splitlines() or ["?"])[-1]
            raise ValueError(f"the agentaccel in {folder} does not import here: {last}")
        schema = int(r.stdout)
        if schema not in (SCHEMA_VERSION, 1):  # 1: history.store_for hands it a copy marked 1
            raise ValueError(f"the agentaccel in {folder} reads trace store schema {schema}, this one writes "
                             f"{SCHEMA_VERSION}: it cannot be given the history")
        return cls(folder, schema)


def plugin_source(folder: Path) -> str:
    """Why `folder` cannot give an agentaccel@LABEL server its plugin ("" where it can): it must hold
    an installed agentaccel, its native core built (`pip install --no-deps --target FOLDER <checkout>`)."""
    package = folder / "agentaccel"
    if not (package / "__init__.py").is_file():
        return (f"{folder} holds no agentaccel package "
                f"(install one there: pip install --no-deps --target {folder} <checkout>)")
    if not any(package.glob("_core*.so")) and not any(package.glob("_core*.pyd")):
        return (f"{folder}/agentaccel has no native core built (_core*.so): "
                "install it with pip, not by copying the source")
    return ""


def source_env(source: Path) -> dict:
    """A process importing agentaccel from `source`, ahead of this checkout: first on the path, and
    source_first/sitecustomize.py taking an editable install's import hook out of its way, and no
    working folder put before them (PYTHONSAFEPATH: `python -m vllm...` run from a checkout would
    otherwise import the checkout's agentaccel, without its native core)."""
    return {"AGENTACCEL_SOURCE": str(source), "PYTHONSAFEPATH": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(SOURCE_FIRST), str(source), os.environ.get("PYTHONPATH", "")]))}
