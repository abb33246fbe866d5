"""The layering docs/ARCHITECTURE.md draws, checked on the imports: a lower layer never imports a
higher one, and engine and traces import neither each other."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "agentaccel"
LEAVES = {"assets", "errors", "jsonfast", "processes", "stop_signals", "_native"}
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
SCRIPTS = ROOT.parent / "scripts"
# the one script that fits: it calibrates the roofline's efficiencies, which the cost home then carries
MAY_FIT = {SCRIPTS / "calibrate_roofline.py"}


def _number(node) -> bool:
    """A literal number other than 0 (0 is no cost at all, not a price)."""
    return isinstance(node, ast.Constant) and isinstance(node.value, int | float) and \
        not isinstance(node.value, bool) and node.value != 0


def cost_leaks(source: str, where: str, may_fit: bool = False) -> list[str]:
    """What in `source` is a second notion of what a step costs: a module-level name with SEED in
    it, a fitting routine, `linear(<number>)` (positional or by keyword), a `cost=<number>`
    argument, or a `cost` field whose default is a number."""
    wrong = []
    tree = ast.parse(source)
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name) and "SEED" in name.id.upper():
                    wrong.append(f"{where}:{node.lineno} defines {name.id}")
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "cost" \
                and node.value is not None and _number(node.value):
            wrong.append(f"{where}:{node.lineno} prices a draft token again (cost = {node.value.value})")
        if not isinstance(node, ast.Call):
            continue
        called = node.func.attr if isinstance(node.func, ast.Attribute) else \
            node.func.id if isinstance(node.func, ast.Name) else ""
        if called in FITTING and not may_fit:
            wrong.append(f"{where}:{node.lineno} fits something ({called})")
        if called == "linear" and any(_number(arg) for arg in [*node.args, *(k.value for k in node.keywords)]):
            wrong.append(f"{where}:{node.lineno} writes a seed again ({ast.unparse(node)})")
        for keyword in node.keywords:
            if keyword.arg == "cost" and _number(keyword.value):
                wrong.append(f"{where}:{node.lineno} prices a draft token again ({ast.unparse(node)})")
    return wrong


def test_what_a_step_costs_has_one_home():
    """Outside engine/cost/ (the package and scripts/): no fitting routine (a linear solve or a
    curve fit; scripts/calibrate_roofline.py aside, which calibrates what the home carries), no
    seed constant, no price of a draft token written as a number: each would be a second notion
    of what a step costs."""
    wrong = []
    for path in sorted([*ROOT.rglob("*.py"), *SCRIPTS.glob("*.py")]):
        if COST_HOME not in path.parents:
            wrong += cost_leaks(path.read_text(), str(path.relative_to(ROOT.parent)), may_fit=path in MAY_FIT)
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("planted", [
    "from agentaccel.engine.cost import linear\nGROWTH = linear(per_token=0.02)",
    "from agentaccel.engine.cost import linear\nGROWTH = linear(0.02)",
    "from agentaccel.engine import SpecConfig\nSPEC = SpecConfig(tree=False, cost=0.02)",
    "from dataclasses import dataclass\n@dataclass\nclass Policy:\n    cost: float = 0.02",
    "CPU_SEED = 0.06",
    "import numpy as np\nfit = np.linalg.lstsq(np.eye(2), np.ones(2))",
])
def test_the_one_home_check_finds_each_kind_of_leak(planted):
    assert cost_leaks(planted, "planted.py"), planted


def module_imports() -> dict[str, set[str]]:
    """Each module of the package (dotted name) -> the modules of ours it imports, wherever the
    import stands (at the top, in a function, under TYPE_CHECKING): `from a.b import c` is the
    module a.b.c where there is one, else a.b."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    target = f"{node.module}.{a.name}"
                    if target in modules or node.module in modules:
                        graph[name].add(target if target in modules else node.module)
        graph[name].discard(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, without recursion)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_two_modules_import_each_other_even_through_others():
    """Imports run one way between modules too, not only between layers: a module that needs
    another's names at run time, in a function or only for its types still depends on it."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check itself
    assert not circles(module_imports()), circles(module_imports())


def test_the_backends_read_their_settings_in_one_place():
    """What a backend is told comes as arguments, and what the vLLM plugin's workers are told as one
    PluginSettings (backends/vllm/settings.py, its on/off switch included): no other module of
    backends/ names an environment variable of ours or reads the environment (the managed vLLM
    backend hands its environment on to vLLM, and reads nothing of it)."""
    folder = ROOT / "backends"
    wrong = []
    for path in sorted(folder.rglob("*.py")):
        where = path.relative_to(folder).as_posix()
        if where == "vllm/settings.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            named = isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value.startswith("AGENTACCEL_")
            read = isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                isinstance(node.ctx, ast.Load) and where != "vllm/backend.py"
            if named or read:
                wrong.append(f"{where}:{node.lineno}")
    assert not wrong, f"settings of a backend read outside its settings: {wrong}"


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
        # agent_tasks: task data; source_first: imported by Python itself at the start of a bench
        # vllm agentaccel@LABEL server (bench/vllm/releases.py puts its folder on the path)
        if path.name in ("__init__.py", "__main__.py") or {"agent_tasks", "source_first"} & set(path.parts):
            continue
        if name not in used:
            orphans.append(str(path.relative_to(repo)))
    assert not orphans, "imported by tests only (move them under tests/): " + ", ".join(orphans)
