"""Which source files decide what a pass does: its module and the enn modules it imports.

Read statically (the modules' import statements, function-local ones included; those under
``if TYPE_CHECKING:`` are not run and do not count): a pass's ``uuid()`` hashes these files,
and tests/test_import_graph.py checks the same edges for cycles.

Importing ``a.b.c`` runs ``a`` and ``a.b`` first; those parent packages are not edges of
``a.b.c``'s importer (each package's own imports are its edges).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

from .. import compat

ROOT = "enn_backend"


@dataclass(frozen=True)
class Import:
    """One import statement's target, as an enn module name."""

    module: str
    top_level: bool  # run when the importing module is imported (not inside a function)
    line: int


@functools.lru_cache(maxsize=None)
def package_dirs(package: str) -> tuple[str, ...]:
    """The folders of an enn package (``()`` if ``package`` is a plain module or none)."""
    parent, _, leaf = package.rpartition(".")
    if parent:
        parent_dirs = package_dirs(parent)
        if not parent_dirs:
            return ()  # the parent is a plain module: ``package`` is one of its attributes
        for d in parent_dirs:
            if os.path.isfile(os.path.join(d, leaf, "__init__.py")):
                return (os.path.join(d, leaf),)
    # the root, or a package installed elsewhere (custom_ops / lowerings, see pyproject.toml)
    spec = importlib.util.find_spec(package)
    return tuple(spec.submodule_search_locations or ()) if spec is not None else ()


@functools.lru_cache(maxsize=None)
def module_file(name: str) -> Optional[str]:
    """The file of enn module ``name``, or None when ``name`` is not a module."""
    parent, _, leaf = name.rpartition(".")
    if not parent:
        spec = importlib.util.find_spec(name)
        return spec.origin if spec is not None else None
    parent_dirs = package_dirs(parent)
    for d in parent_dirs:
        for path in (os.path.join(d, leaf, "__init__.py"), os.path.join(d, leaf + ".py")):
            if os.path.isfile(path):
                return path
    dirs = package_dirs(name) if parent_dirs else ()
    return os.path.join(dirs[0], "__init__.py") if dirs else None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST) -> list[tuple[ast.stmt, bool]]:
    """(import statement, top level?) pairs, skipping ``if TYPE_CHECKING:`` bodies."""
    found: list[tuple[ast.stmt, bool]] = []

    def walk(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    walk_one(stmt, top)
                continue
            walk_one(child, top)

    def walk_one(node: ast.AST, top: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append((node, top))
            return
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        walk(node, inner)

    walk(tree, True)
    return found


@functools.lru_cache(maxsize=None)
def imports_of(name: str) -> tuple[Import, ...]:
    """The enn modules that module ``name`` imports."""
    path = module_file(name)
    if path is None:
        raise ValueError(f"{name!r} is not an enn module")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out: dict[str, Import] = {}

    def add(module: str, top: bool, line: int) -> None:
        if (module == ROOT or module.startswith(ROOT + ".")) and module != name:
            old = out.get(module)
            if old is None or (top and not old.top_level):
                out[module] = Import(module, top, line)

    for stmt, top in _statements(tree):
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                add(alias.name, top, stmt.lineno)
            continue
        base = package
        for _ in range(stmt.level - 1):
            base = base.rpartition(".")[0]
        base = ".".join(p for p in (base if stmt.level else "", stmt.module or "") if p)
        for alias in stmt.names:
            sub = f"{base}.{alias.name}"
            add(sub if module_file(sub) is not None else base, top, stmt.lineno)
    return tuple(out.values())


@functools.lru_cache(maxsize=None)
def module_files(name: str) -> tuple[str, ...]:
    """The files of enn module ``name`` and of every enn module it imports, transitively."""
    seen: set[str] = set()
    stack = [name]
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        stack.extend(i.module for i in imports_of(m))
    return tuple(sorted(f for f in (module_file(m) for m in seen) if f is not None))


@functools.lru_cache(maxsize=None)
def sources_hash(*names: str) -> str:
    """A hash of the files that decide enn modules ``names`` (see :func:`module_files`)."""
    return compat.hash_files(sorted({f for n in names for f in module_files(n)}))
