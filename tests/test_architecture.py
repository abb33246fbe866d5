"""The layering docs/ARCHITECTURE.md draws, checked on the imports: a lower layer never imports a
higher one, and engine and traces import neither each other."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "agentaccel"
LEAVES = {"assets", "errors", "jsonfast", "processes", "_native"}
ALLOWED = {  # package -> what it may import of ours (besides itself)
    **{leaf: set() for leaf in LEAVES},
    "text": {"assets"},
    "traces": {"text"} | LEAVES,
    "engine": LEAVES,
    "backends": {"engine", "traces", "text"} | LEAVES,
    "proxy": {"backends", "traces", "text"} | LEAVES,
    "adapters": {"traces", "text"} | LEAVES,
    "bench": {"adapters", "backends", "engine", "traces", "text"} | LEAVES,
    "cli": {"adapters", "backends", "bench", "engine", "proxy", "traces", "text"} | LEAVES,
}


def imports_of_ours(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        found |= {n.split(".")[1] for n in names if n.startswith("agentaccel.")}
    return found


def test_every_import_follows_the_layers():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        package = parts[0] if len(parts) > 1 else path.stem
        if package == "__init__":
            continue
        assert package in ALLOWED, f"{package}: a new package; give it a place in ARCHITECTURE.md and here"
        for target in imports_of_ours(path) - {package} - ALLOWED[package]:
            wrong.append(f"{path.relative_to(ROOT.parent)} imports agentaccel.{target}")
    assert not wrong, "\n".join(wrong)
