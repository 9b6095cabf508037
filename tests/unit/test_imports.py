"""The house's shape: the package's modules import one another without a circle (function-level
imports counted too: a lazy import that closes a circle only hides it), each part of ``runtime/``
imports only the parts below it, ``runtime/`` nothing of the modes' callers, and no module is
longer than a newcomer reads in one sitting."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "deepspeed_offload"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set:
    """The package modules ``path`` imports, anywhere in it (resolved to modules, not packages'
    re-exports: ``from . import x`` names the module x when x is one)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("deepspeed_offload"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("deepspeed_offload")}
    return {m for m in out if m in modules and m != name}


def test_no_import_circle():
    # every edge counts, a package's __init__ included (one that defines functions is a module like any)
    graph = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}
    state, cycle = {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                cycle.append(path + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycle, cycle


def test_the_ground_floor_imports_nothing_of_the_package():
    for name in ("errors.py", "handle.py"):
        assert imports_of(PACKAGE / name) == set(), name


# runtime/'s parts, lowest first: a part imports only parts of a lower rank (and its own modules)
RUNTIME_RANKS = {"agreement": 0, "patches": 0, "staging": 0, "memory": 1, "speculation": 2, "colocation": 2,
                 "checkpoint": 2, "attach": 3, "step": 4}
# what picks and drives a mode: runtime/ imports none of it
ABOVE_RUNTIME = ("compile_passes", "api", "cli", "install", "integrations", "bench", "teardown")
MAX_LINES = 400


def runtime_part(module: str):
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "runtime" else None


def upward(name: str, deps) -> list:
    """The imports of module ``name`` that break the rule: of a mode's caller, or of a part of
    ``runtime/`` not below its own."""
    part, out = runtime_part(name), []
    for dep in deps:
        other = runtime_part(dep)
        if dep.split(".")[1] in ABOVE_RUNTIME or (part and other and other != part
                                                   and RUNTIME_RANKS[other] >= RUNTIME_RANKS[part]):
            out.append((name, dep))
    return out


def test_runtime_parts_import_only_the_parts_below_them():
    assert set(RUNTIME_RANKS) | {"__init__"} >= {p.stem if p.is_file() else p.name
                                                 for p in (PACKAGE / "runtime").iterdir() if p.name != "__pycache__"}
    bad = [edge for path in (PACKAGE / "runtime").rglob("*.py") for edge in upward(module_name(path), imports_of(path))]
    assert not bad, bad


def test_an_upward_import_is_caught():
    """The rule above can fail: memory importing the step, a part importing compile mode, a part
    importing one of its own rank; importing within a part or downward passes."""
    rt = "deepspeed_offload.runtime."
    assert upward(rt + "memory.placement", [rt + "step.stream"])
    assert upward(rt + "step.stream", ["deepspeed_offload.compile_passes"])
    assert upward(rt + "speculation.updates", [rt + "colocation.offload_states"])
    assert not upward(rt + "step.stream", [rt + "step.setup", rt + "memory.residency", rt + "staging.copies",
                                           "deepspeed_offload.config"])


def test_no_module_is_longer_than_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
