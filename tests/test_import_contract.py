"""The import contract: the package tree is the process split, and dependencies point one way.

Read from the source (every import statement, also those inside functions), so a lazy import cannot hide a
dependency:

    harness.rollout     the worker process: never the trainer's side (harness.training)
    harness.generation  the client side of generation: neither the rollout nor the training side
    harness.weight_sync the transport of weights: neither the rollout loop nor the trainer
    harness.server      the built-in server process: neither the rollout nor the training side
    tools, sandboxes    know nothing of harness or environments
    environments        may use tools and sandboxes, never harness

Also: no module imports another module's private (underscored) name, and no two modules import each other
at import time (a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("harness", "tools", "sandboxes", "environments")
FORBIDDEN = {
    "harness.rollout": ("harness.training",),
    "harness.generation": ("harness.rollout", "harness.training"),
    "harness.weight_sync": ("harness.rollout", "harness.training"),
    "harness.server": ("harness.rollout", "harness.training"),
    "tools": ("harness", "environments"),
    "sandboxes": ("harness", "environments"),
    "environments": ("harness",),
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


MODULES = modules()


def imports(path: Path, *, top_level_only: bool = False) -> list[tuple[str, list[str], int]]:
    """(module, names imported from it, line) for each absolute import of the file."""
    source = path.read_text(encoding="utf-8")
    for attempt in range(5):
        try:
            tree = ast.parse(source)
            break
        except SystemError:  # CPython 3.11's AST depth count is shared by threads (python/cpython#106905):
            if attempt == 4:  # another thread of this process parsing at the same time fails this one
                raise
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names], node.lineno))
    return found


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_tree_has_the_process_split():
    for package in ("harness.rollout", "harness.training", "harness.weight_sync", "harness.generation"):
        assert package in MODULES, f"{package} is missing"
    assert "harness.rollout.loop" in MODULES and "harness.training.trainer" in MODULES


@pytest.mark.parametrize("side", sorted(FORBIDDEN))
def test_each_side_imports_only_what_it_may(side):
    broken = []
    for name, path in MODULES.items():
        if not within(name, side):
            continue
        for module, _, line in imports(path):
            for forbidden in FORBIDDEN[side]:
                if within(module, forbidden):
                    broken.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not broken, "\n".join(broken)


def test_no_module_imports_another_modules_private_name():
    broken = []
    for name, path in MODULES.items():
        for module, names, line in imports(path):
            if module == name or module.split(".")[0] not in PACKAGES:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {private} from {module}")
    assert not broken, "\n".join(broken)


def test_no_import_cycle_at_import_time():
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for module, names, _ in imports(path, top_level_only=True):
            submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
            targets = submodules + ([module] if len(submodules) < len(names) or not names else [])
            graph[name] |= {target for target in targets if target in MODULES and target != name}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)
