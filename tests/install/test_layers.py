"""The package's modules import only downward: no import cycle, counting the imports made
inside functions (issue: a cycle closed by deferred imports is still a cycle to read)."""
import ast
import os

from tests.support import ROOT
from tests.support.requires import needs_source_tree

pytestmark = needs_source_tree  # it reads the checkout's sources

PKG = os.path.join(ROOT, "collectives")


def _modules():
    mods = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py") or f.endswith(".pyx"):  # extensions: leaves
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT).rsplit(".", 1)[0].replace(os.sep, ".")
                if rel.endswith(".__init__"):
                    rel = rel[:-len(".__init__")]
                mods[rel] = path
    return mods


def _imports(name, path, known):
    """Modules of the package that ``name`` imports anywhere in its source. ``from . import
    x`` runs the package's ``__init__`` before it finds ``x``, so it counts as importing
    both (only the top package's ``__init__``, which gathers the public names, is exempt)."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base[:len(base) - node.level + 1]
                mod = ".".join(parts + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            cands = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            cands = [a.name for a in node.names]
        else:
            continue
        for c in cands:
            while c and c not in known:
                c = c.rpartition(".")[0]
            if c and c != name and c != "collectives":
                out.add(c)
    return out


def _cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, comps, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return comps


def test_no_module_imports_back_up_the_package():
    mods = _modules()
    # the package's __init__ gathers the public names: importing it from below is not a
    # layer going up only when nothing below does it, so it counts like any other module
    graph = {m: _imports(m, p, mods) if p.endswith(".py") else set() for m, p in mods.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# ---- the shared-memory engine's C layers ---------------------------------------------

SRC = os.path.join(PKG, "src")
# each shm C file, lowest layer first, and the shm headers it may include: a layer calls
# only functions of its own layer or of the layers below it
SHM_LAYERS = [
    ("shm_segment.c", {"shm_sync.h"}),
    ("shm_copy.c", {"shm_copy.h"}),
    ("shm_tune.c", {"shm_tune.h"}),
    ("shm_p2p.c", {"shm_sync.h"}),
    ("shm_coll.c", {"shm_copy.h", "shm_tune.h"}),
]
SHM_HEADERS = {"shm_sync.h": set(), "shm_copy.h": {"shm_sync.h"}, "shm_tune.h": {"shm_sync.h"}}
# layers that sit side by side (neither may call the other)
SHM_SIBLINGS = {frozenset({"shm_copy.c", "shm_tune.c"}), frozenset({"shm_copy.c", "shm_p2p.c"}),
                frozenset({"shm_tune.c", "shm_p2p.c"})}


def _c_source(name):
    import re
    text = open(os.path.join(SRC, name)).read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)  # comments name other layers freely
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def _c_defined(text):
    """Functions a C file defines (at the start of a line, with a body)."""
    import re
    return set(re.findall(r"^(?:[A-Za-z_][\w \*]*?[\s\*])?(\w+)\s*\([^;{]*\)\s*\{", text, re.M))


def test_the_shm_engines_c_files_call_only_down_their_layers():
    """shm_segment.c (segment, counters, waits, failure record, fingerprints) at the bottom;
    the copy policy, the measured choice and p2p above it; the collectives on top: no file
    includes a header of a layer above it, nor calls a function a file above it (or beside
    it) defines. An abort reaches p2p through the hook p2p registers."""
    import re
    srcs = {name: _c_source(name) for name, _ in SHM_LAYERS}
    defined = {name: _c_defined(text) for name, text in srcs.items()}
    assert all(defined.values()), defined
    problems = []
    for h, allowed in SHM_HEADERS.items():
        got = set(re.findall(r'#include "(shm_\w+\.h)"', open(os.path.join(SRC, h)).read()))
        got.discard("shm_coll.h")  # the engine's public declarations: every layer's
        problems += [f"{h} includes {g}" for g in got - allowed]
    order = [name for name, _ in SHM_LAYERS]
    for i, (name, allowed) in enumerate(SHM_LAYERS):
        got = set(re.findall(r'#include "(shm_\w+\.h)"', srcs[name])) - {"shm_coll.h"}
        problems += [f"{name} includes {g}" for g in got - allowed]
        for other in order:
            above = order.index(other) > i or frozenset({name, other}) in SHM_SIBLINGS
            if other == name or not above:
                continue
            for fn in defined[other] - defined[name]:
                if re.search(rf"\b{fn}\s*\(", srcs[name]):
                    problems.append(f"{name} calls {fn} of {other}")
    assert not problems, problems


def _private_backend_reads(path):
    """``be._x`` / ``<...>.backend._x`` reads in a module: a backend's private state."""
    tree = ast.parse(open(path).read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            v = node.value
            if (isinstance(v, ast.Name) and v.id in ("be", "backend")) or \
                    (isinstance(v, ast.Attribute) and v.attr == "backend"):
                out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} .{node.attr}")
    return out


def test_the_front_end_reads_a_backend_only_through_its_contract():
    """Above backends/, a backend is used through backends/base.py's public contract
    (``pending``, the collectives, ``submit``/``run``...), never its private state."""
    found = []
    for name, path in _modules().items():
        if path.endswith(".py") and not name.startswith("collectives.backends"):
            found += _private_backend_reads(path)
    assert found == []


def test_the_private_read_finder_finds_one(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f(pg, be):\n    return pg.backend._busy or be._queue or be.pending.n\n")
    assert [r.split(" ")[1] for r in _private_backend_reads(str(p))] == ["._busy", "._queue"]
