"""The package's modules import only downward, by layer: each folder (and each public module
at the top level) sits in one layer of LAYERS, and a module imports from its own layer or the
layers below it, never above, counting the imports made inside functions and the modules
named in strings (``importlib.import_module``, ``sys.modules.get``), and the extensions'
imports and cimports (their .pyx with the .pxi files it includes). No import cycle either (a
cycle closed by deferred imports is still a cycle to read)."""
import ast
import itertools
import os
import re

from tests.support import ROOT
from tests.support.requires import needs_source_tree

pytestmark = needs_source_tree  # it reads the checkout's sources

PKG = os.path.join(ROOT, "collectives")

# The layers, lowest first: (name, the folders and top-level modules in it, relative to
# collectives/; "" is the package's own __init__). docs/architecture.md draws this tree.
LAYERS = [
    ("settings", ["config"]),
    ("core", ["core", "security"]),  # the vocabulary: errors, dtypes, ops, options, fingerprint...
    ("extensions", ["engines"]),  # compiled: their .pyx (and .pxi) imports count as a module's
    # core's modules that take a compiled engine or its Python twin (and those built on them)
    ("buffers", ["core.tensors", "core.work", "core.kernels_numpy", "core.convert", "core.cuda",
                 "core.reduction", "core.staging"]),
    ("services", ["store", "launcher"]),
    ("backends", ["backends"]),
    ("diagnostics", ["diagnostics"]),
    ("api", ["api"]),
    ("bridges", ["torch_bridge", "master_worker"]),
    # the package, its __main__ and the modules named as torch.distributed's public ones
    ("public", ["", "__main__", "constants", "distributed_c10d", "nn", "run"]),
    # written on the public API, as a user's program is: elastic training in place
    ("programs", ["elastic"]),
]
# Known imports up the layers, each with its reason: (importer, imported). The list only
# shrinks (the test fails when an entry is no longer needed).
UPWARD = {}
# (the three edges that went up are hooks now, registered by the layer above: the torch
# bridge's, api/group.set_torch_bridge; the flight recorder's dump, backends/base.set_dump_hook;
# collectives-info reads the package's version and folder without importing it)


def _modules():
    mods = {}
    for dirpath, dirs, files in os.walk(PKG):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py") or f.endswith(".pyx"):  # extensions: their imports count too
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT).rsplit(".", 1)[0].replace(os.sep, ".")
                if rel.endswith(".__init__"):
                    rel = rel[:-len(".__init__")]
                mods[rel] = path
    return mods


def _string_target(arg, base):
    """The module a string names: "collectives.x", ".x" (from the package ``base``),
    ``__package__ + ".x"`` or ``f"{__package__}.x"``; None for anything else."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        s = arg.value
        if s.startswith("."):
            level = len(s) - len(s.lstrip("."))
            return ".".join(base[:len(base) - level + 1] + ([s[level:]] if s[level:] else []))
        return s
    if isinstance(arg, ast.BinOp) and getattr(arg.left, "id", None) == "__package__" \
            and isinstance(arg.right, ast.Constant) and isinstance(arg.right.value, str):
        return ".".join(base) + arg.right.value
    if isinstance(arg, ast.JoinedStr) and len(arg.values) == 2 \
            and isinstance(arg.values[0], ast.FormattedValue) \
            and getattr(arg.values[0].value, "id", None) == "__package__" \
            and isinstance(arg.values[1], ast.Constant):
        return ".".join(base) + arg.values[1].value
    return None


def _named_module(node, base):
    """The module that ``importlib.import_module(...)``, ``sys.modules.get(...)`` or
    ``sys.modules[...]`` names, where a string spells it out; else None."""
    if isinstance(node, ast.Call) and node.args:
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        modules_get = name == "get" and isinstance(f, ast.Attribute) and \
            getattr(f.value, "attr", None) == "modules"
        if name == "import_module" or modules_get:
            return _string_target(node.args[0], base)
    if isinstance(node, ast.Subscript) and getattr(node.value, "attr", None) == "modules":
        return _string_target(node.slice, base)
    return None


def _imports(name, path, known):
    """Modules of the package that ``name`` imports anywhere in its source. ``from .x import
    y`` runs the package ``x``'s ``__init__`` too, so it counts as importing both; the top
    package counts only where a name is taken from it (``from .. import config`` reaches the
    subpackage, ``from collectives import all_reduce`` the public namespace)."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    add = _recorder(name, known, out)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _absolute(base, node.level, node.module)
            _add_from(add, mod, [a.name for a in node.names], known)
        elif isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        else:
            target = _named_module(node, base)
            if target and target.startswith("collectives"):
                add(target)
    return out


def _recorder(name, known, out):
    """``add(module)``: puts in ``out`` the module of ``known`` that ``module`` names (or the
    nearest package of ``known`` above it), unless that is ``name`` itself."""
    def add(c):
        while c and c not in known:
            c = c.rpartition(".")[0]
        if c and c != name:
            out.add(c)
    return add


def _absolute(base, level, module):
    """The module that ``from <level dots><module> import`` names in package ``base`` (its
    name's parts)."""
    if not level:
        return module or ""
    return ".".join(base[:len(base) - level + 1] + ([module] if module else []))


def _add_from(add, mod, names, known):
    """The edges of ``from mod import names``: ``mod`` (the top package only where a name is
    taken from it), and each name that is itself a module of ``known``."""
    if mod != "collectives":
        add(mod)
    for n in names:
        if f"{mod}.{n}" in known:
            add(f"{mod}.{n}")
        elif mod == "collectives":
            add(mod)


def _layer_of(mod):
    """The index in LAYERS of a module (by its longest placed prefix); None if unplaced."""
    rel = mod[len("collectives."):] if mod.startswith("collectives.") else ""
    best, where = -1, None
    for i, (_, places) in enumerate(LAYERS):
        for p in places:
            if (rel == p or (p and rel.startswith(p + "."))) and len(p) > best:
                best, where = len(p), i
    return where


_CY_INCLUDE = re.compile(r'^include\s+"([^"]+)"', re.M)
_CY_FROM = re.compile(r"^[ \t]*from[ \t]+(\.*[\w.]*)[ \t]+c?import[ \t]+\(?([\w ,\t]+)", re.M)
_CY_IMPORT = re.compile(r"^[ \t]*c?import[ \t]+([\w.]+)", re.M)


def _cython_source(path):
    """A .pyx file's text with the .pxi files it includes (recursively)."""
    text = open(path).read()
    for inc in _CY_INCLUDE.findall(text):
        text += "\n" + _cython_source(os.path.join(os.path.dirname(path), inc))
    return text


def _cython_imports(name, path, known):
    """Modules of the package that the extension ``name`` imports or cimports (at module
    level or inside functions, in its .pyx and the .pxi files it includes): the same
    edges as a Python module's, read with patterns since Cython is not Python's grammar."""
    text = re.sub(r"#.*", "", _cython_source(path))
    base = name.split(".")[:-1]
    out = set()
    add = _recorder(name, known, out)
    for mod, names in _CY_FROM.findall(text):
        level = len(mod) - len(mod.lstrip("."))
        mod = _absolute(base, level, mod[level:])
        if mod.startswith("collectives"):
            _add_from(add, mod, [n.split()[0] for n in names.split(",") if n.split()], known)
    for mod in _CY_IMPORT.findall(text):
        if mod.startswith("collectives"):
            add(mod)
    return out


def _graph():
    mods = _modules()
    return {m: (_imports if p.endswith(".py") else _cython_imports)(m, p, mods)
            for m, p in mods.items()}


def _upward(graph):
    """(importer, imported) pairs where the imported module sits in a higher layer (an
    unplaced module is test_every_module_has_a_layer's to report)."""
    return [(m, d) for m, deps in sorted(graph.items()) for d in sorted(deps)
            if None not in (_layer_of(m), _layer_of(d)) and _layer_of(d) > _layer_of(m)]


def test_every_module_has_a_layer():
    assert [m for m in _modules() if _layer_of(m) is None] == []


def test_no_module_imports_a_layer_above_its_own():
    got = _upward(_graph())
    assert [e for e in got if e not in UPWARD] == []
    assert [e for e in UPWARD if e not in got] == []  # gone: take it off UPWARD


def test_the_layer_check_finds_an_import_upward(tmp_path):
    """An import of the api from core/ (inside a function, or through importlib or
    sys.modules) is found, and its layers are in the wrong order."""
    known = {"collectives.core", "collectives.core.tensors", "collectives.api", "collectives.api.group"}
    p = tmp_path / "tensors.py"
    p.write_text("def f():\n    from ..api import group\n    return group\n")
    deps = _imports("collectives.core.tensors", str(p), known)
    assert deps == {"collectives.api", "collectives.api.group"}
    assert _upward({"collectives.core.tensors": deps}) == [
        ("collectives.core.tensors", "collectives.api"),
        ("collectives.core.tensors", "collectives.api.group")]
    p.write_text("import importlib\nimport sys\n\n\ndef f():\n"
                 "    return importlib.import_module('..api.group', __package__)\n\n\n"
                 "def g():\n    return sys.modules.get('collectives.api.group')\n")
    assert _imports("collectives.core.tensors", str(p), known) == {"collectives.api.group"}
    assert _upward({"collectives.api.group": {"collectives.core.tensors"}}) == []


def test_the_layer_check_reads_an_extensions_imports(tmp_path):
    """A .pyx's cimports and imports count, those of the .pxi files it includes too, inside
    functions as well; comments do not."""
    known = {"collectives.engines", "collectives.engines._x", "collectives.engines._buffer",
             "collectives.core", "collectives.core.tensors", "collectives.config", "collectives.api"}
    (tmp_path / "_x.pyx").write_text(
        'from ._buffer cimport Buffer\nfrom .. import config as _config\ninclude "_y.pxi"\n'
        "# from ..api import group\n")
    (tmp_path / "_y.pxi").write_text("def f():\n    from ..core.tensors import to_buffer\n")
    deps = _cython_imports("collectives.engines._x", str(tmp_path / "_x.pyx"), known)
    assert deps == {"collectives.engines._buffer", "collectives.config",
                    "collectives.core.tensors"}
    assert ("collectives.engines._x", "collectives.core.tensors") in _upward(
        {"collectives.engines._x": deps})


def test_every_folder_is_a_package_that_the_wheel_lists():
    """Each folder of modules has an __init__.py, and pyproject.toml's package list names
    every one (the wheel would leave the others out)."""
    found, missing = set(), []
    for dirpath, dirs, files in os.walk(PKG):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if any(f.endswith(".py") for f in files):
            name = os.path.relpath(dirpath, ROOT).replace(os.sep, ".")
            found.add(name)
            if "__init__.py" not in files:
                missing.append(name)
    assert missing == []
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    listed = re.search(r"^packages\s*=\s*\[([^\]]*)\]", text, re.M).group(1)
    assert set(re.findall(r'"([\w.]+)"', listed)) == found


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


def test_no_import_cycle():
    """(UPWARD's known edges aside, which the layer test lists: each closes a cycle.)"""
    graph = {m: {d for d in deps if (m, d) not in UPWARD} for m, deps in _graph().items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# ---- the shared-memory engine's C layers ---------------------------------------------

SRC = os.path.join(PKG, "engines", "shm")  # the shm engine's C sources
# each shm C file, lowest layer first, and the shm headers it may include: a layer calls
# only functions of its own layer or of the layers below it
SHM_LAYERS = [
    ("shm_segment.c", {"shm_sync.h"}),
    ("shm_copy.c", {"shm_copy.h"}),
    ("shm_tune.c", {"shm_tune.h"}),
    ("shm_mapped.c", {"shm_mapped.h"}),
    ("shm_p2p.c", {"shm_sync.h"}),
    ("shm_coll.c", {"shm_copy.h", "shm_tune.h", "shm_mapped.h"}),
]
SHM_HEADERS = {"shm_sync.h": set(), "shm_copy.h": {"shm_sync.h"}, "shm_tune.h": {"shm_sync.h"},
               "shm_mapped.h": {"shm_sync.h"}}
# layers that sit side by side (neither may call the other)
SHM_SIBLINGS = {frozenset(pair) for pair in itertools.combinations(
    ("shm_copy.c", "shm_tune.c", "shm_mapped.c", "shm_p2p.c"), 2)}


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
    the copy policy, the measured choice, the mapped all_reduce and p2p above it; the
    collectives on top: no file includes a header of a layer above it, nor calls a function
    a file above it (or beside it) defines, and every file of engines/shm is in a layer
    here. An abort reaches p2p through the hook p2p registers."""
    import re
    on_disk = {f for f in os.listdir(SRC) if f.endswith((".c", ".h"))}
    listed = {name for name, _ in SHM_LAYERS} | set(SHM_HEADERS) | {"shm_coll.h"}
    assert on_disk == listed, f"files of engines/shm not in a layer here: {on_disk - listed}"
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
    p.write_text("def f(pg, be):\n    return pg.backend._thread or be._queue or be.pending.n\n")
    assert [r.split(" ")[1] for r in _private_backend_reads(str(p))] == ["._thread", "._queue"]
