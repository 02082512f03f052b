"""The import graph runs one way: each part of kdacp imports only parts below it in :data:`ORDER`,
function-level (lazy) imports included, and no module imports itself back through others."""
import ast
from pathlib import Path

import kdacp

ROOT = Path(kdacp.__file__).parent

# Lowest first; a part may import only the parts before it (the package's own __init__ is the facade
# above them all). The layering of STYLE.md: validation -> reference, kernels -> backends ->
# distributed, ops -> layers -> bench, demo -> cli.
ORDER = ("affine", "validation", "reference", "kernels", "backends", "distributed", "kda", "gdn", "layers",
         "models", "precompile", "workers", "demo", "bench", "tuning", "cli")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set) -> set:
    """The kdacp modules ``path`` imports anywhere in its body."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "kdacp"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "kdacp":
                module = node.module
            else:
                continue
            # ``from package import submodule`` imports the submodule
            subs = {f"{module}.{a.name}" for a in node.names} & modules
            found |= subs or {module}
    return found


def _graph() -> dict:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) & modules for p in paths}


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_part_is_placed():
    assert {_part(m) for m in _graph()} - {None} == set(ORDER)


def test_parts_import_only_parts_below():
    upward = []
    for module, targets in _graph().items():
        part = _part(module)
        if part is None:
            continue
        for target in targets:
            other = _part(target)
            if other != part and (other is None or ORDER.index(other) > ORDER.index(part)):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run upward: " + ", ".join(sorted(upward))


def test_no_module_cycles():
    graph = _graph()
    state: dict = {}

    def visit(module, trail):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(target):] + [target]))
            if target not in state:
                visit(target, trail + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
