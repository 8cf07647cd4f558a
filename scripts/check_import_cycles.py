"""Fail when src/kvreuse has an import cycle, between modules or between packages.

The layering itself is import-linter's contract (``[tool.importlinter]`` in pyproject.toml,
``lint-imports``); this check covers what a layers contract does not: two modules of one
package importing each other, and any cycle through a package a contract does not name.
Imports under ``if TYPE_CHECKING:`` and inside functions count: a cycle a type checker or a
late import hides is still a cycle a reader has to hold in their head.

A package cycle is counted between the top-level packages of kvreuse (``kvreuse.cache``,
``kvreuse.engine``, ...; a root module such as ``kvreuse.cli`` stands for itself): package A
imports package B when any module under A imports any module under B. The root package's
``__init__`` (the public ``from kvreuse import LLM``) is left out: every module is under it.

Exits 0 and says so when there is none; exits 1 and prints each cycle (its strongly connected
component, with one import path through it) otherwise. Uses grimp, which import-linter ships.

Usage: python scripts/check_import_cycles.py [PACKAGE]   (default kvreuse; run it with src on
the path, as the installed package or PYTHONPATH=src)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping

import grimp


def strongly_connected(nodes: Iterable[str], edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one node (Tarjan, iterative), each
    sorted, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
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
    return sorted(found)


def one_cycle(component: list[str], edges: Mapping[str, set[str]]) -> list[str]:
    """A shortest path from the component's first node back to itself, through its members."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges.get(node, ())):
                if child == start:
                    return paths[node] + [start]
                if child in members and child not in paths:
                    paths[child] = paths[node] + [child]
                    following.append(child)
        frontier = following
    return component  # not reached: a component of two or more nodes has a cycle through its first


def package_of(module: str, root: str) -> str | None:
    """``root.x.y`` -> ``root.x``; None for the root package's own ``__init__``."""
    parts = module.split(".")
    return None if len(parts) == 1 else ".".join(parts[:2])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("package", nargs="?", default="kvreuse")
    args = ap.parse_args(argv)
    graph = grimp.build_graph(args.package, include_external_packages=False)
    modules = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    packages: dict[str, set[str]] = {}
    examples: dict[tuple[str, str], tuple[str, str]] = {}
    for module, imported in modules.items():
        source = package_of(module, args.package)
        for target in imported:
            dest = package_of(target, args.package)
            if source is None or dest is None or source == dest:
                continue
            packages.setdefault(source, set()).add(dest)
            examples.setdefault((source, dest), (module, target))
    failed = False
    for kind, nodes, edges in (("module", modules.keys(), modules), ("package", packages.keys(), packages)):
        cycles = strongly_connected(nodes, edges)
        for component in cycles:
            failed = True
            path = one_cycle(component, edges)
            print(f"{kind} cycle among {len(component)}: {', '.join(component)}")
            for a, b in zip(path, path[1:]):
                via = f"   ({' -> '.join(examples[(a, b)])})" if kind == "package" else ""
                print(f"    {a} -> {b}{via}")
        if not cycles:
            print(f"no {kind} cycle in {args.package} ({len(nodes)} {kind}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
