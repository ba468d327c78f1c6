"""The package's imports run one way, down the layers the README's Layout section names, without circles.

Every import written in baige_ray/, actors/ and policies/ (at the top of a file or inside a function:
both tie the code together) is read from the source. An import from a lower layer to a higher one, or
a circle of modules importing each other, fails the test. `KNOWN_UPWARD` and `KNOWN_CIRCLES` list the
ones that are left to undo: the test also fails when one of them is gone, so the lists only shrink.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"baige_ray": ROOT / "baige_ray", "baige_ray.actors": ROOT / "actors", "baige_ray.policies": ROOT / "policies"}

# Bottom first. A folder may import its own layer and those below it.
LAYERS = (
    ("api", "constants", "accelerator", "failpoints", "catalog", "lazy_exports"),
    ("parallel",),
    ("policies",),
    ("topology",),
    ("planner", "ops"),
    ("checkpoint",),
    ("models",),
    ("engines",),
    ("runtime",),
    ("serving",),
    ("elastic",),
    ("actors",),
    ("jobs",),
    ("rl",),
    ("bench", "cli", "commands", "package"),
)

KNOWN_UPWARD: set[tuple[str, str]] = set()

KNOWN_CIRCLES: set[frozenset[str]] = set()


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project's modules it imports (a `from package import name` naming a module counts as it)."""
    graph = defaultdict(set)
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            else:
                continue
            graph[module].update(target for target in named if target in modules and target != module)
    return graph


def _folder(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    return parts[1]


def _layer(folder: str) -> int:
    return next(index for index, names in enumerate(LAYERS) if folder in names)


def _circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), set(), [0]
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.add(frozenset(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_every_folder_is_in_one_layer():
    folders = {_folder(module) for module in _modules()}
    named = [folder for layer in LAYERS for folder in layer]
    assert len(named) == len(set(named)), "a folder is named in two layers"
    assert folders <= set(named), f"folders in no layer: {sorted(folders - set(named))}"


def test_imports_point_down_the_layers():
    graph = _imports(_modules())
    upward = defaultdict(list)
    for module, targets in graph.items():
        for target in targets:
            source_folder, target_folder = _folder(module), _folder(target)
            if _layer(target_folder) > _layer(source_folder):
                upward[(source_folder, target_folder)].append(f"{module} -> {target}")
    new = {pair: upward[pair] for pair in set(upward) - KNOWN_UPWARD}
    assert not new, f"imports from a lower layer to a higher one: {new}"
    undone = KNOWN_UPWARD - set(upward)
    assert not undone, f"no longer imported upward, take them off KNOWN_UPWARD: {sorted(undone)}"


def test_no_modules_import_each_other_in_a_circle():
    circles = _circles(_imports(_modules()))
    new = circles - KNOWN_CIRCLES
    assert not new, f"modules importing each other in a circle: {[sorted(c) for c in new]}"
    undone = KNOWN_CIRCLES - circles
    assert not undone, f"circles that are gone, take them off KNOWN_CIRCLES: {[sorted(c) for c in undone]}"
