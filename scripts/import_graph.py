"""The repository's import graph: cycles, and the layers of a package (a module's layer is one above the highest
module it imports; a module importing nothing of the package is layer 1).

Every import statement counts, ``TYPE_CHECKING`` and function-level ones included: a reader follows them all.
Importing ``a.b.c`` counts as importing the module ``a.b.c`` (or, if that is a name, the module ``a.b``);
``from a import b`` imports the module ``a.b`` where there is one, else the package ``a`` (its ``__init__``,
a module like any other).

    python scripts/import_graph.py                 # cycles in the repository, layers of deployments/
    python scripts/import_graph.py --package hetspec
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hetspec", "deployments", "benchmarks", "protos")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "results" not in path.parts:
                found[module_name(path, root)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` is, or is in (``from a.b import c``: ``a.b.c`` if a module, else ``a.b``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The repository's modules ``module`` imports (itself excluded)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from a import b``: the module a.b if there is one, else the name b of module a
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name, known)
            if target is not None and target != module:
                found.add(target)
    return found


def graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    known = modules(root, packages)
    return {module: imports(module, path, known) for module, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def layers(edges: dict[str, set[str]], package: str) -> dict[str, int]:
    """Each module of ``package`` and its layer within the package (imports from outside it do not count).
    Raises ValueError on a cycle inside the package."""
    inside = {module: {other for other in targets if other == package or other.startswith(package + ".")}
              for module, targets in edges.items() if module == package or module.startswith(package + ".")}
    found: dict[str, int] = {}
    visiting: set[str] = set()

    def layer(module: str) -> int:
        if module in found:
            return found[module]
        if module in visiting:
            raise ValueError(f"an import cycle through {module}")
        visiting.add(module)
        found[module] = 1 + max((layer(other) for other in inside[module]), default=0)
        visiting.discard(module)
        return found[module]

    for module in sorted(inside):
        layer(module)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", default="deployments", help="the package whose layers are printed")
    args = parser.parse_args()
    edges = graph()
    found = cycles(edges)
    for component in found:
        print("cycle:", " <-> ".join(component))
    try:
        by_module = layers(edges, args.package)
    except ValueError as error:
        print(f"{args.package}: {error}")
        return 1
    for module, layer in sorted(by_module.items(), key=lambda item: (item[1], item[0])):
        print(f"{layer:2d} {module}")
    print(f"{args.package}: {max(by_module.values(), default=0)} layers; {len(found)} cycles in the repository")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
