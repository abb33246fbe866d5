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
    "simulation": {"backends", "engine", "traces", "text"} | LEAVES,
    "bench": {"adapters", "backends", "engine", "simulation", "traces", "text"} | LEAVES,
    "cli": {"adapters", "backends", "bench", "engine", "proxy", "simulation", "traces", "text"} | LEAVES,
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


COST_HOME = ROOT / "engine" / "cost"  # what a step costs: the model, the fitting, the seeds and profiles
FITTING = {"solve", "lstsq", "polyfit", "least_squares", "curve_fit", "minimize"}


def test_what_a_step_costs_has_one_home():
    """Outside engine/cost/: no fitting routine (a linear solve or a curve fit), no seed constant
    (a module-level name with SEED in it, a `linear(<number>)`): they would be a second notion of
    what a step costs."""
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        if COST_HOME in path.parents:
            continue
        tree = ast.parse(path.read_text())
        where = path.relative_to(ROOT.parent)
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name) and "SEED" in name.id.upper():
                        wrong.append(f"{where}:{node.lineno} defines {name.id}")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            called = node.func.attr if isinstance(node.func, ast.Attribute) else \
                node.func.id if isinstance(node.func, ast.Name) else ""
            if called in FITTING:
                wrong.append(f"{where}:{node.lineno} fits something ({called})")
            if called == "linear" and node.args and isinstance(node.args[0], ast.Constant):
                wrong.append(f"{where}:{node.lineno} writes a seed again (linear({node.args[0].value}))")
    assert not wrong, "\n".join(wrong)


def test_the_vllm_plugin_reads_its_settings_in_one_place():
    """What the plugin is told comes as one PluginSettings (backends/vllm/settings.py): no other
    module of the vLLM backend names an environment variable of ours or reads the environment
    (the plugin's on/off switch, read by vLLM's plugin loader, aside)."""
    folder = ROOT / "backends" / "vllm"
    wrong = []
    for path in sorted(folder.glob("*.py")):
        if path.name in ("settings.py", "plugin.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            named = isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value.startswith("AGENTACCEL_")
            read = isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                isinstance(node.ctx, ast.Load) and path.name != "backend.py"  # backend.py hands its environment on
            if named or read:
                wrong.append(f"{path.name}:{node.lineno}")
    assert not wrong, f"settings of the vLLM plugin read outside settings.py: {wrong}"


def test_only_the_trace_store_runs_sql_on_it():
    """Each table's queries live in traces/ (its own module, or store.py for the calls): nothing
    else reaches the store's connection or runs a statement, on SQLite or PostgreSQL alike (both go
    through the same Connection)."""
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).parts[0] == "traces":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("conn", "execute", "executemany", "executescript",
                                                                  "script"):
                wrong.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} .{node.attr}")
    assert not wrong, f"SQL outside traces/: {wrong}"


def _modules_used_by_the_product() -> set[str]:
    """Dotted names of our modules that the package itself, its entry points, scripts/ or
    examples/ import or run (`python -m`, vLLM's plugin entry point)."""
    repo = ROOT.parent
    used: set[str] = set()
    sources = [*ROOT.rglob("*.py"), *(repo / "scripts").rglob("*.py"), *(repo / "examples").rglob("*.py")]
    for path in sources:
        text = path.read_text()
        here = ".".join(path.relative_to(repo).with_suffix("").parts) if path.is_relative_to(ROOT) else ""
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                used |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package
                    base = ".".join([*here.split(".")[: -node.level], *([base] if base else [])])
                used |= {base} | {f"{base}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                used |= {word.split(":")[0] for word in node.value.split() if word.startswith("agentaccel.")}
    words = [word.strip('"') for word in (repo / "pyproject.toml").read_text().split()]  # entry points
    used |= {word.split(":")[0] for word in words if word.startswith("agentaccel.")}
    return used


def test_no_module_in_the_package_serves_only_the_tests():
    """Code that only tests use lives under tests/: every module of the package is imported (or
    run) by the product, its scripts or its examples."""
    used = _modules_used_by_the_product()
    repo = ROOT.parent
    orphans = []
    for path in sorted(ROOT.rglob("*.py")):
        name = ".".join(path.relative_to(repo).with_suffix("").parts)
        if path.name in ("__init__.py", "__main__.py") or "agent_tasks" in path.parts:  # agent_tasks: task data
            continue
        if name not in used:
            orphans.append(str(path.relative_to(repo)))
    assert not orphans, "imported by tests only (move them under tests/): " + ", ".join(orphans)
