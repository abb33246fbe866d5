"""Runs the classic OpenHands core (`openhands.core.main`, the arguments as given) under its own
Python (>= 3.12), by path, importing nothing of agentaccel, with the Jupyter plugin left out of
the CodeAct agent's sandbox when the config turns the agent's Jupyter tool off: `enable_jupyter =
false` only removes the tool, and the runtime would still start a Jupyter kernel gateway on
0.0.0.0 for nothing."""

import os
import runpy
import sys
import tomllib


def jupyter_wanted(argv: list[str]) -> bool:
    if "--config-file" not in argv:
        return True
    with open(argv[argv.index("--config-file") + 1], "rb") as f:
        return tomllib.load(f).get("agent", {}).get("enable_jupyter", True)


if __name__ == "__main__":
    # run by path, this folder would come first on sys.path and shadow packages of the same names
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    if not jupyter_wanted(sys.argv[1:]):
        from openhands.agenthub.codeact_agent.codeact_agent import CodeActAgent
        from openhands.runtime.plugins import JupyterRequirement

        CodeActAgent.sandbox_plugins = [p for p in CodeActAgent.sandbox_plugins
                                        if not isinstance(p, JupyterRequirement)]
    sys.argv = ["openhands.core.main", *sys.argv[1:]]
    runpy.run_module("openhands.core.main", run_name="__main__", alter_sys=True)
