"""Print skylift's package-level import graph; exit 1 on a cycle or an arrow that points upward.

    python scripts/import_graph.py          # the graph, then any problem found
    python scripts/import_graph.py --files  # also every file-level import inside skylift/

Every import counts, the ones inside functions and under `TYPE_CHECKING` too: a lazy import is
still a dependency. Packages are the first component below `skylift` (`skylift.inference.local`
-> `inference`); a module at the top (`cli.py`) is a package of its own.

Layers (an arrow may only point to a lower layer, or stay inside its package):

    cli                          (skylift/cli.py)
    demo, entrypoints, viewer    (skylift/demo.py, skylift/entrypoints/, skylift/viewer/: `skylift view`)
    compat, integrations         (other projects' interfaces: SkyRL; verifiers, OpenEnv, tinker-cookbook)
    rl, tinker                   (the RL step; the Tinker service)
    cluster                      (what a run is made of: Ray, engines, worker groups)
    gateway                      (the OpenAI-compatible endpoint agent programs are trained through)
    generator, data
    inference, worker            (never import each other)
    weight_sync
    config, models, algorithms, envs, tracking, skylift (skylift/__init__.py: the version)
    utils                        (imports no other skylift package)

The wing rule: `compat` and `integrations` import the core; no other package imports them, not even
the layers above (`WINGS`). The core reaches them only by name: its registries (`envs/registry.py`,
`generator/plugins.py`, the config loader's dialects, the metrics, eval-dump and route hooks) hold
their dotted module names and import them with importlib on first use, which is no arrow here.

Problems reported: a cycle between packages, a cycle between files, an arrow to a higher layer or
within a layer across packages, an arrow from outside the wing into `compat` or `integrations`. `ALLOWED_FILE_CYCLES` lists the file cycles other work is
removing; it only shrinks.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "skylift"

LAYERS: list[set[str]] = [
    {"cli"},
    {"demo_pipeline"},  # `skylift demo --task sft-rl`: on the demo's parts
    {"demo", "entrypoints", "viewer"},
    {"compat", "integrations"},
    {"supervised"},  # beside rl, over it: the supervised stages reuse its checkpoint layout
    {"rl", "tinker"},
    {"cluster"},
    {"gateway"},
    {"generator", "data"},
    {"inference", "worker"},
    {"weight_sync"},
    {"config", "models", "algorithms", "envs", "tracking", PACKAGE},
    {"utils"},
]

#: Other projects' interfaces: they import the core, nothing outside them imports them.
WINGS: set[str] = {"compat", "integrations"}

#: File cycles being removed by work in flight (issue 14, item 4: Tinker's service and its
#: collaborators). Each entry is the sorted tuple of the files in one cycle.
ALLOWED_FILE_CYCLES: set[tuple[str, ...]] = set()

#: Rooms whose own folders are layered too (the same rule, one level down): a unit is a sub-folder
#: or a top-level module of the room. The Tinker service: the app and the service that wires the
#: features; the features, each above the ones it uses; vision (image rendering); core (the
#: requests: hub, ordered queues, submit, the training gate; the wire and bodies); storage (records);
#: errors (what every layer raises).
ROOM_LAYERS: dict[str, list[set[str]]] = {
    "tinker": [
        {"tinker", "commands"},
        {"app"},
        {"openapi", "service"},
        {"sessions"},
        {"checkpoints"},
        {"training"},
        {"sampling"},
        {"vision"},
        {"core"},
        {"storage"},
        {"errors"},
    ],
}


def layer_of(package: str) -> int:
    for depth, names in enumerate(LAYERS):
        if package in names:
            return depth
    raise KeyError(f"package {package!r} has no layer: add it to LAYERS in {Path(__file__).name}")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return PACKAGE
    return parts[1]  # a subpackage, or a top-level module such as skylift.cli


def imported_modules(path: Path, module: str) -> Iterable[tuple[str, str]]:
    """What `path` imports, as (module, fallback) pairs: `from a import b` is module `a.b` when
    that is a module, else `a` (absolute and relative imports, at any depth)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                keep = len(base) - node.level + (1 if is_package else 0)
                prefix = ".".join(base[:keep])
                target = f"{prefix}.{node.module}" if node.module else prefix
            else:
                target = node.module or ""
            for alias in node.names:
                yield f"{target}.{alias.name}", target


def file_graph() -> dict[str, set[str]]:
    """File -> the skylift files it imports (paths relative to the repository)."""
    files = sorted((ROOT / PACKAGE).rglob("*.py"))
    by_module = {module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        module = module_name(path)
        deps: set[str] = set()
        for target, fallback in imported_modules(path, module):
            if target.split(".")[0] != PACKAGE:
                continue
            found = by_module.get(target) or by_module.get(fallback)
            if found is not None and found != path:
                deps.add(str(found.relative_to(ROOT)))
        graph[str(path.relative_to(ROOT))] = deps
    return graph


def package_graph(files: dict[str, set[str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for src, deps in files.items():
        a = package_of(module_name(ROOT / src))
        graph.setdefault(a, set())
        for dst in deps:
            b = package_of(module_name(ROOT / dst))
            if b != a:
                graph[a].add(b)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[tuple[str, ...]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                item = stack.pop()
                on_stack.discard(item)
                component.append(item)
                if item == node:
                    break
            if len(component) > 1:
                out.append(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(out)


def direction_problems(packages: dict[str, set[str]], files: dict[str, set[str]]) -> list[str]:
    problems = []
    for src, deps in sorted(packages.items()):
        for dst in sorted(deps):
            if layer_of(dst) < layer_of(src) or (layer_of(dst) == layer_of(src)):
                culprits = sorted(
                    f
                    for f, targets in files.items()
                    if package_of(module_name(ROOT / f)) == src
                    and any(package_of(module_name(ROOT / t)) == dst for t in targets)
                )
                what = "across one layer" if layer_of(dst) == layer_of(src) else "upward"
                problems.append(f"{src} -> {dst} points {what} (in {', '.join(culprits)})")
            elif dst in WINGS and src not in WINGS:
                culprits = sorted(
                    f
                    for f, targets in files.items()
                    if package_of(module_name(ROOT / f)) == src
                    and any(package_of(module_name(ROOT / t)) == dst for t in targets)
                )
                problems.append(
                    f"{src} -> {dst} imports the compatibility wing (in {', '.join(culprits)}): "
                    "reach it through a registry by module name"
                )
    return problems


def room_unit(room: str, module: str) -> str | None:
    """The unit of `room` that `module` belongs to (its sub-folder or top-level module; the room's
    ``__init__`` is the room itself), or None outside the room."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] != room:
        return None
    return parts[2] if len(parts) > 2 else room


def room_problems(room: str, layers: list[set[str]], files: dict[str, set[str]]) -> list[str]:
    """Cycles and arrows that do not point downward between the units of one room."""

    def depth(unit: str) -> int:
        for d, names in enumerate(layers):
            if unit in names:
                return d
        raise KeyError(
            f"{room}/{unit} has no layer: add it to ROOM_LAYERS[{room!r}] in {Path(__file__).name}"
        )

    graph: dict[str, set[str]] = {}
    culprits: dict[tuple[str, str], set[str]] = {}
    for src, deps in files.items():
        a = room_unit(room, module_name(ROOT / src))
        if a is None:
            continue
        graph.setdefault(a, set())
        for dst in deps:
            b = room_unit(room, module_name(ROOT / dst))
            if b is not None and b != a:
                graph[a].add(b)
                culprits.setdefault((a, b), set()).add(src)
    problems = [
        f"{room}/{a} -> {room}/{b} points {'across one layer' if depth(a) == depth(b) else 'upward'} "
        f"(in {', '.join(sorted(culprits[a, b]))})"
        for a in sorted(graph)
        for b in sorted(graph[a])
        if depth(b) <= depth(a)
    ]
    problems += [f"{room} folder cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", action="store_true", help="also print the file-level graph")
    args = parser.parse_args(argv)

    files = file_graph()
    packages = package_graph(files)
    print("package imports (layer: package -> what it imports):")
    for package in sorted(packages, key=lambda p: (layer_of(p), p)):
        deps = ", ".join(sorted(packages[package], key=lambda p: (layer_of(p), p))) or "-"
        print(f"  {layer_of(package)}: {package:<12} -> {deps}")
    if args.files:
        print("file imports:")
        for src in sorted(files):
            for dst in sorted(files[src]):
                print(f"  {src} -> {dst}")

    problems = direction_problems(packages, files)
    problems += [f"package cycle: {' <-> '.join(c)}" for c in cycles(packages)]
    for room, layers in ROOM_LAYERS.items():
        problems += room_problems(room, layers, files)
    allowed = []
    for cycle in cycles(files):
        if cycle in ALLOWED_FILE_CYCLES:
            allowed.append(cycle)
        else:
            problems.append(f"file cycle: {' <-> '.join(cycle)}")
    for cycle in allowed:
        print(f"allowed for now (being removed): file cycle {' <-> '.join(cycle)}")
    for cycle in sorted(ALLOWED_FILE_CYCLES - set(allowed)):
        problems.append(f"allow-list entry {cycle} no longer occurs: remove it from ALLOWED_FILE_CYCLES")
    for problem in problems:
        print(f"PROBLEM {problem}")
    print("ok: no cycle, every arrow points downward" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
