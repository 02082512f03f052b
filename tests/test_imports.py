"""The import graph runs one way: each part of kdacp imports only parts below it in :data:`ORDER`,
function-level (lazy) imports included, and no module imports itself back through others."""
import ast
from pathlib import Path

import kdacp

ROOT = Path(kdacp.__file__).parent

# Lowest first; a part may import only the parts before it (the package's own __init__ is the facade
# above them all). The layering of STYLE.md: validation -> reference, kernels -> backends -> cp (context
# parallelism) -> ops -> layers -> bench, demo -> cli; the names of choices (torch-free) under all.
# ``distributed`` is the deprecated alias of ``cp`` (it names bench's rank role too), above bench; ``kda`` and
# ``gdn`` are the deprecated aliases of ``ops.kda`` and ``ops.gdn``, above ops (nothing may import an alias).
ORDER = ("choices", "caches", "host_copies", "compile", "affine", "validation", "sequences", "reference", "kernels", "backends", "cp", "ops", "kda", "gdn", "layers",
         "integrations", "precompilation", "workers", "demo", "bench", "models", "distributed", "tuning", "options", "commands", "cli")


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


# the deprecated aliases (one release): users' old paths, which no module of kdacp imports
ALIASES = ("kdacp.distributed", "kdacp.layers.context_parallel", "kdacp.kda", "kdacp.gdn")


def test_no_module_imports_a_deprecated_alias():
    users = sorted(f"{module} -> {target}" for module, targets in _graph().items() for target in targets
                   if target in ALIASES and module not in ALIASES)
    assert not users, "modules that import a deprecated alias: " + ", ".join(users)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(path: Path, modules: set) -> list[str]:
    """``path``'s uses of another kdacp module's private names: ``from kdacp.x import _y``, and ``x._y``
    where ``x`` names a kdacp module it imported."""
    own = _module_name(path) if path.is_relative_to(ROOT) else None
    package = None if own is None else (own if path.name == "__init__.py" else own.rsplit(".", 1)[0])
    tree = ast.parse(path.read_text())
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {a.asname for a in node.names if a.asname and a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "kdacp" or module == own:
                continue
            for a in node.names:
                if _private(a.name):
                    found.append(f"{path.name}:{node.lineno} imports {module}.{a.name}")
                elif f"{module}.{a.name}" in modules:
                    bound.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name) \
                and node.value.id in bound:
            found.append(f"{path.name}:{node.lineno} reads {node.value.id}.{node.attr}")
    return found


def test_no_private_name_is_read_across_modules():
    """Modules of kdacp, and the benchmark scripts, use each other's public names only."""
    modules = {_module_name(p) for p in ROOT.rglob("*.py")}
    scripts = sorted(ROOT.rglob("*.py")) + sorted((ROOT.parents[1] / "benchmarks").glob("*.py"))
    found = [use for path in scripts for use in _private_uses(path, modules)]
    assert not found, "private names used across modules: " + "; ".join(found)


def test_strategy_auto_does_not_load_the_benchmark_model():
    """``strategy="auto"`` needs the exchange's cost model only: importing kdacp and resolving a plan's
    strategy leaves the scaling benchmark's simulator (shared cores, FLA's scheme) unloaded."""
    import subprocess
    import sys
    code = ("import sys, kdacp; from kdacp.cp.plan import rank_layouts, resolve_strategy; "
            "print(resolve_strategy('auto', rank_layouts(None, 1, (64,) * 4))[0], 'kdacp.bench.scaling_model' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split()[1] == "False", out.stdout + out.stderr


def test_the_top_level_exports_what_users_call():
    """``kdacp`` exports the ops, plans, layers, model helpers, precompile and the reference; internals
    (the summary algebra, the kernel launchers) stay in their modules."""
    assert {"chunk_kda", "chunk_gated_delta_rule", "build_cp_plan", "global_token_mean_loss"} <= set(kdacp.__all__)
    assert not {"AffineMap", "state_summary", "transition", "compose_state_summaries"} & set(kdacp.__all__)
    assert all(hasattr(kdacp, name) for name in kdacp.__all__)


def test_no_exported_name_is_also_a_submodule():
    """Importing ``kdacp.<name>`` sets the package's attribute ``name`` to that submodule, so an exported function
    of the same name would turn into a module once anything imports the submodule (order-dependent)."""
    import importlib.util
    clashes = [name for name, module in kdacp._EXPORTS.items()
               if module is not None and importlib.util.find_spec(f"kdacp.{name}") is not None]
    assert not clashes, f"exported names that are also submodules: {clashes}"
