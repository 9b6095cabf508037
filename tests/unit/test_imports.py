"""The package's modules import one another without a circle (function-level imports counted too:
a lazy import that closes a circle only hides it)."""

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
    graph = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}
    # the package __init__ files re-export their modules: the edges that matter are module to module
    graph = {m: {d for d in deps if not d.endswith("__init__")} for m, deps in graph.items()}
    state, cycle = {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if d == "deepspeed_offload" or d in ("deepspeed_offload.runtime", "deepspeed_offload.compile_passes",
                                                  "deepspeed_offload.bench", "deepspeed_offload.runtime.checkpoint"):
                continue  # a package's __init__ (a re-export)
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
