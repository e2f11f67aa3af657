"""enn_backend's import graph (read statically by enn_backend.passes.sources): no import cycles,
no function-local imports of enn modules beyond the known ones listed here, and the attention
package's layers import only downwards.

The allow-list holds what exists outside the layering redesign; each entry goes when its lazy
import is removed (the test then fails until the entry is deleted: it only shrinks).
"""

from __future__ import annotations

import ast
import pkgutil

from enn_backend.passes import sources

ROOT = sources.ROOT

# Function-local imports of enn modules (importer -> imported) allowed: none. Code imports at the
# top of the module; the one exception is a documented lazy import of a heavy optional dependency
# (not an enn module).
KNOWN_LOCAL_IMPORTS: set[tuple[str, str]] = set()

# The attention package, lowest layer first: a module imports only modules of earlier layers.
A = "enn_backend.passes.attention"
ATTENTION_LAYERS = (
    {f"{A}.softmax"},  # the softmax forms the matcher reads
    {f"{A}.problem", f"{A}.match", f"{A}.emitter", f"{A}.constants"},
    {f"{A}.provenance"},
    {f"{A}.masks", f"{A}.regions"},
    {f"{A}.key_padding"},  # band flags + key padding, and the dead rows' closed form
    {f"{A}.kernels.sdpa", f"{A}.kernels.flex", f"{A}.kernels.enn_op"},
    {f"{A}.kernels.flex_padding"},  # a model's own SDPA call with left padding, as flex
    {f"{A}.kernels"},
    {f"{A}.policy"},
    {f"{A}.plan"},
    {f"{A}.rewrite", f"{A}.sdpa_calls"},  # the two edits: a fused site, a model's own SDPA call
    {A},
)


def _modules() -> set[str]:
    """Every enn module: the package's files, and what they import (custom_ops / lowerings are
    installed inside the package from folders beside it)."""
    found: set[str] = set()
    queue = [ROOT]
    while queue:
        m = queue.pop()
        if m in found:
            continue
        found.add(m)
        if sources.module_file(m).endswith("__init__.py"):
            queue += [f"{m}.{info.name}" for info in pkgutil.iter_modules(list(sources.package_dirs(m)))]
        queue += [i.module for i in sources.imports_of(m)]
    return found


def _cycles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: set[frozenset[str]] = set()
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.add(frozenset(comp))
    return out


def _edges() -> dict[str, set[str]]:
    return {m: {i.module for i in sources.imports_of(m)} for m in _modules()}


def test_no_import_cycles():
    cycles = _cycles(_edges())
    assert not cycles, f"import cycle(s): {sorted(sorted(c) for c in cycles)}"


def test_no_function_local_imports_of_enn_modules_beyond_the_known_ones():
    local = {(m, i.module) for m in _modules() for i in sources.imports_of(m) if not i.top_level}
    assert not local - KNOWN_LOCAL_IMPORTS, f"function-local enn imports: {sorted(local - KNOWN_LOCAL_IMPORTS)}"
    assert not KNOWN_LOCAL_IMPORTS - local, f"gone: delete from KNOWN_LOCAL_IMPORTS: {sorted(KNOWN_LOCAL_IMPORTS - local)}"


def test_passes_import_no_higher_layer():
    """The passes depend on options, report, compat, custom ops and the neutral FX helpers
    (enn_backend.fx_utils); never on the guard, the backend, the compiler, the caches or the tools."""
    higher = ("enn_backend.backend", "enn_backend.graph_compiler", "enn_backend.aot_cache", "enn_backend.guard",
              "enn_backend.debug", "enn_backend.bench", "enn_backend.demo", "enn_backend.cli")
    for m, deps in _edges().items():
        if m.startswith("enn_backend.passes"):
            bad = sorted(d for d in deps if d.startswith(higher))
            assert not bad, f"{m} imports {bad}"


def test_the_guard_and_the_passes_share_fx_helpers_through_a_neutral_module():
    """The FX helpers both sides use live in enn_backend.fx_utils, which imports neither side (torch
    and compat only); the guard imports no pass (and the passes no guard module: above)."""
    edges = _edges()
    deps = {i.module for i in sources.imports_of("enn_backend.fx_utils")}
    assert deps <= {"enn_backend.compat"}, f"enn_backend.fx_utils imports {sorted(deps)}"
    users = {m for m, d in edges.items() if "enn_backend.fx_utils" in d}
    assert {"enn_backend.passes.fp32_tail", "enn_backend.guard.graph_edit", "enn_backend.guard.ladder"} <= users
    for m, d in edges.items():
        if m == "enn_backend.guard" or m.startswith("enn_backend.guard."):
            bad = sorted(x for x in d if x == "enn_backend.passes" or x.startswith("enn_backend.passes."))
            assert not bad, f"{m} imports {bad}"


def test_attention_layers_import_downwards():
    rank = {m: i for i, layer in enumerate(ATTENTION_LAYERS) for m in layer}
    attention = {m for m in _modules() if m == A or m.startswith(A + ".")}
    assert attention == set(rank), f"modules missing from ATTENTION_LAYERS: {sorted(attention - set(rank))}"
    for m in attention:
        for d in (i.module for i in sources.imports_of(m)):
            if d in rank:
                assert rank[d] < rank[m], f"{m} imports {d}, which is not in a lower layer"


def test_the_static_reader_sees_relative_local_and_type_checking_imports():
    deps = {i.module: i for i in sources.imports_of(f"{A}.kernels.sdpa")}
    assert f"{A}.emitter" in deps and deps[f"{A}.emitter"].top_level  # from ..emitter import ...
    assert "enn_backend.custom_ops.attention" in deps  # from ....custom_ops.attention import ...
    assert f"{A}.plan" not in deps  # imported under `if TYPE_CHECKING:` only
    # an import inside a function is read too, marked as not run at import time
    tree = ast.parse("def f():\n    from . import report\nimport os\n")
    assert [(type(st).__name__, top) for st, top in sources._statements(tree)] == [("ImportFrom", False), ("Import", True)]
    # `from . import x` names a submodule (an edge to it); `from .m import name` an attribute of m
    face = {i.module for i in sources.imports_of("enn_backend.passes")}
    assert {"enn_backend.passes.manager", f"{A}.kernels.flex"} <= face


def test_a_pass_uuid_covers_its_own_sources_only():
    files = {f.replace("\\", "/").rsplit("/", 2)[-2] + "/" + f.rsplit("/", 1)[-1] for f in sources.module_files(A)}
    assert {"attention/plan.py", "attention/op.py", "attention/safe_paths.py"} <= files
    assert not {"enn_backend/demo.py", "bench/runner.py", "enn_backend/backend.py", "passes/epilogue.py"} & files


def _private_torch_imports(path: str) -> list[str]:
    """``torch._x`` modules and ``_name``s of torch modules that the file at ``path`` imports."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for st, _ in sources._statements(tree):
        if isinstance(st, ast.Import):
            found += [a.name for a in st.names if a.name.split(".")[0] == "torch" and
                      any(p.startswith("_") for p in a.name.split("."))]
        elif st.level == 0 and st.module and st.module.split(".")[0] == "torch":
            private = any(p.startswith("_") for p in st.module.split("."))
            found += [f"{st.module}.{a.name}" for a in st.names if private or a.name.startswith("_")]
    return found


def test_private_torch_imports_live_in_compat():
    """Every private torch import (a ``torch._x`` module, a ``_name`` of a torch module) is in
    enn_backend.compat; other modules read ``compat.X``."""
    bad = {}
    for m in _modules():
        if m == "enn_backend.compat" or m.startswith("enn_backend.compat."):
            continue
        found = _private_torch_imports(sources.module_file(m))
        if found:
            bad[m] = found
    assert not bad, f"private torch imports outside enn_backend.compat: {bad}"
    # the reader sees compat's own private imports (a module, and a name from one)
    found = _private_torch_imports(sources.module_file("enn_backend.compat.inductor"))
    assert {"torch._inductor.config", "torch._inductor.compile_fx.compile_fx_inner"} <= set(found), found


# Modules that read what the report recorded, and why: the report is enn's output, and nothing
# else reads it back to decide what enn does (the guard's ranks send the ladder's decision itself).
REPORT_READERS = {
    "enn_backend.report": "the report itself",
    "enn_backend.aot_cache": "persists a unit's recorded compile-time decisions beside its cached graphs, to "
                             "replay them on a warm start",
}
REPORT_READER_PACKAGES = ("enn_backend.bench", "enn_backend.debug")  # tools that show or save the report
_REPORT_READS = {"fallbacks", "graphs", "counters", "to_dict", "units"}


def test_no_code_reads_the_report_back_to_decide():
    found = []
    for name in _modules():
        if name in REPORT_READERS or name.startswith(REPORT_READER_PACKAGES) or name == "enn_backend.demo":
            continue
        with open(sources.module_file(name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in _REPORT_READS and isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "id", getattr(node.value.func, "attr", "")) == "report"):
                found.append(f"{name}:{node.lineno}: report().{node.attr}")
    assert not found, found
    assert "enn_backend.guard.ranks" in _modules()  # the walk sees the guard
