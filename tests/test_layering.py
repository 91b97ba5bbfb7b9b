"""The package's import graph follows DESIGN §5: levels import only downward, no cycles, and no
module imports the package root (the CLI and the demo aside). Parsed from the source, so the
layering cannot rot unseen."""

from __future__ import annotations

import ast
import os
from collections import defaultdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Units from the ground up (DESIGN §5); a unit is a subpackage or a module directly in mla_ops/.
LEVELS = [
    {"_checks", "_env", "_mla", "_source_tree"},
    {"planning", "triton"},
    {"ops"},
    {"chunk_loop", "lowering"},
    {"parallel"},
    {"step"},
    {"prefill"},
    {"models"},
    {"serving"},
    {"__init__"},
    {"__main__", "demo"},
    {"integrations"},  # engines running mla-ops (DESIGN §13): on the public API; nothing imports them
]
LEVEL = {unit: i for i, units in enumerate(LEVELS) for unit in units}
MAY_IMPORT_ROOT = {"__main__", "demo", "integrations"}
# Imports inside a function, run when it is called (every module loaded by then), that close a loop: a record's
# public constructor reaching the reader that stands above it (DESIGN §11's MLAConfig.from_hf -> hf_config).
DEFERRED = {("mla_ops.models.config", "mla_ops.models.hf_config")}


def source_files() -> dict[str, str]:
    """Module name -> file, for mla_ops/ and lowering/ (which installs as mla_ops.lowering)."""
    files = {}
    for folder, package in (("mla_ops", "mla_ops"), ("lowering", "mla_ops.lowering")):
        for dirpath, _, names in os.walk(os.path.join(ROOT, folder)):
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            prefix = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
            for name in names:
                if name.endswith(".py"):
                    module = prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"
                    files[module] = os.path.join(dirpath, name)
    return files


def is_package(module: str, files: dict[str, str]) -> bool:
    return files[module].endswith("__init__.py")


def type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines inside ``if TYPE_CHECKING:`` blocks (annotations only: no runtime import)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, child.end_lineno + 1))
    return lines


def function_lines(tree: ast.AST) -> set[int]:
    """Lines inside function bodies (imports there run when the function is called)."""
    return {line for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for line in range(node.body[0].lineno, node.end_lineno + 1)}


def imports(module: str, files: dict[str, str], module_level: bool = False) -> list[tuple[str, int, bool]]:
    """``(imported module, line, imports a name of the package root)`` for every runtime import of ours
    (``module_level``: only those made when the module loads)."""
    tree = ast.parse(open(files[module]).read())
    skip = type_checking_lines(tree) | (function_lines(tree) if module_level else set())
    package = module if is_package(module, files) else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, a.name == "mla_ops") for a in node.names if a.name.startswith("mla_ops")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("mla_ops"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in files:
                    found.append((sub, node.lineno, False))
                else:
                    found.append((target, node.lineno, target == "mla_ops"))
    return found


def unit(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def graph() -> dict[str, set[str]]:
    files = source_files()
    return {m: {t for t, _, _ in imports(m, files) if t != m} for m in files}


def test_every_unit_has_a_level():
    assert {unit(m) for m in source_files()} <= set(LEVEL), "a new module or subpackage needs a level"


def test_imports_go_downward():
    files = source_files()
    upward = []
    for module in files:
        for target, line, _ in imports(module, files):
            a, b = unit(module), unit(target)
            if a != b and LEVEL[b] >= LEVEL[a]:
                upward.append(f"{os.path.relpath(files[module], ROOT)}:{line} {module} -> {target}")
    assert not upward, "imports that go up or sideways (DESIGN §5):\n" + "\n".join(upward)


def test_no_module_imports_the_package_root():
    files = source_files()
    bad = [f"{module}:{line}" for module in files for _, line, root in imports(module, files)
           if root and unit(module) not in MAY_IMPORT_ROOT]
    assert not bad, bad


def test_no_import_cycle():
    edges = {m: targets - {t for d, t in DEFERRED if d == m} for m, targets in graph().items()}
    state: dict[str, int] = defaultdict(int)  # 0 new, 1 on the stack, 2 done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(edges.get(module, ())):
            if target not in edges:
                continue
            if state[target] == 1:
                cycle = stack[stack.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if state[target] == 0:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(edges):
        if state[module] == 0:
            visit(module)


def test_at_most_twelve_modules_directly_in_the_package():
    direct = [n for n in os.listdir(os.path.join(ROOT, "mla_ops")) if n.endswith(".py")]
    assert len(direct) <= 12, sorted(direct)


def test_deferred_imports_stay_in_functions():
    files = source_files()
    for module, target in DEFERRED:
        assert target in {t for t, _, _ in imports(module, files)}, f"{module} no longer imports {target}: drop it"
        assert target not in {t for t, _, _ in imports(module, files, module_level=True)}, \
            f"{module} imports {target} when it loads: a cycle"


def test_config_is_the_floor_of_models():
    """``MLAConfig`` stands below every other module of models/ (its readers, checkpoints, parts): when it loads it
    imports only the scaling records of its fields, and of planning/ only the routing default's formula."""
    files = source_files()
    ours = {t for t, _, _ in imports("mla_ops.models.config", files, module_level=True)}
    assert {t for t in ours if t.startswith("mla_ops.models.")} <= {"mla_ops.models.scalings"}, sorted(ours)
    assert {t for t in ours if t.startswith("mla_ops.planning")} <= {"mla_ops.planning.routing"}, sorted(ours)
