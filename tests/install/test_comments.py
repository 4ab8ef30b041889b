"""Comments and docstrings in collectives/ say what the code does and why, not where or
when it was measured or written: none cites a VM, a work session, an issue number or a path
outside the repository (measured figures live in docs/ and bench/results/). Read from the
sources (.py, .pyi, .pyx, .pxi, .pxd, .c, .h; not the C that Cython generates)."""
import os
import re

from tests.support import ROOT
from tests.support.requires import needs_source_tree

pytestmark = needs_source_tree  # it reads the checkout's sources

PKG = os.path.join(ROOT, "collectives")
PY_EXT = (".py", ".pyi", ".pyx", ".pxi", ".pxd")
C_EXT = (".c", ".h")

# What a comment must not cite: (what, pattern). Ordinary words stay allowed: a POSIX
# session ("runs in its own session"), a debugger's session, "this host".
FORBIDDEN = [
    ("a VM", re.compile(r"\bVMs?\b|\bvCPUs?\b")),
    ("a work session", re.compile(
        r"\b(?:this|that|an? earlier|earlier|the previous|previous|the last|last|a later|"
        r"later|the next|next|prior|helper)\s+sessions?\b|\bsessions?\s+\d+", re.I)),
    ("an issue number", re.compile(r"\bissues?\s*#?\s*\d+|\bgh-\d+", re.I)),
    ("a path outside the repository", re.compile(r"\.\./shared/|/work/|/home/\w")),
]

# Files not checked yet, each with its reason. The set only shrinks: the test fails when an
# entry has nothing left to find. backends/shm.py: its constants block's benchmark notes
# move out with the rewrite of its defaults into the settings registry.
PENDING = {"collectives/backends/shm.py"}

_PY_COMMENT = re.compile(r'"""(.*?)"""|\'\'\'(.*?)\'\'\'|"(?:\\.|[^"\\\n])*"'
                         r"|'(?:\\.|[^'\\\n])*'|#([^\n]*)", re.S)
_C_COMMENT = re.compile(r'/\*(.*?)\*/|//([^\n]*)|"(?:\\.|[^"\\\n])*"', re.S)


def _comments(path, text):
    """``(line, text)`` of each comment and triple-quoted string (docstrings) in ``text``;
    one-line string literals (messages, keys) are skipped, they are not comments."""
    pattern = _C_COMMENT if path.endswith(C_EXT) else _PY_COMMENT
    for m in pattern.finditer(text):
        body = next((g for g in m.groups() if g is not None), None)
        if body is not None:
            yield text.count("\n", 0, m.start()) + 1, body


def _sources():
    for dp, dns, fs in os.walk(PKG):
        dns[:] = sorted(d for d in dns if d not in ("__pycache__", "build"))
        for f in sorted(fs):
            p = os.path.join(dp, f)
            if f.endswith(PY_EXT):
                yield p
            elif f.endswith(C_EXT):
                stem = os.path.splitext(p)[0]
                if not (os.path.exists(stem + ".pyx") or os.path.exists(stem + ".py")):
                    yield p  # C next to a .pyx of its name is Cython's output


def findings(path):
    """``"file:line: cites <what>: <text>"`` for each forbidden citation in ``path``."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    rel = os.path.relpath(path, ROOT)
    out = []
    for line, body in _comments(path, text):
        for what, pat in FORBIDDEN:
            for m in pat.finditer(body):
                at = line + body.count("\n", 0, m.start())
                out.append(f"{rel}:{at}: cites {what}: {m.group(0)!r}")
    return out


def test_no_comment_cites_a_vm_a_session_an_issue_or_an_outside_path():
    found, cleared = [], set()
    for p in _sources():
        rel = os.path.relpath(p, ROOT).replace(os.sep, "/")
        if rel not in PENDING:
            found += findings(p)
        elif not findings(p):
            cleared.add(rel)
    assert found == [], "\n".join(found)
    assert cleared == set(), "nothing left to find there: take them out of PENDING"


def test_the_sources_read_include_the_c_engines_and_not_cythons_output():
    rel = {os.path.relpath(p, PKG).replace(os.sep, "/") for p in _sources()}
    assert {"engines/shm/shm_coll.c", "engines/shm/shm_copy.h", "engines/_shm.pyx",
            "engines/_group_dispatcher.pxi", "api/group.py"} <= rel
    assert not {r for r in rel if re.fullmatch(r"engines/_\w+\.c", r)}


def test_the_finder_finds_each_kind_and_spares_ordinary_words(tmp_path):
    py = tmp_path / "m.py"
    py.write_text('"""Measured on this VM."""\n'
                  "x = 1  # see issue 31\n"
                  "y = subprocess.Popen(a, start_new_session=True)  # its own session\n"
                  "z = '# issue 7 in a string is data, not a comment'\n"
                  "def f():\n    '''As in this session's runs (../shared/tools/x.py).'''\n")
    c = tmp_path / "m.c"
    c.write_text("/* two ranks on the 2-vCPU VM:\n * 6.5 us */\nint x; // issue #12\n"
                 'const char *s = "an earlier session";\n')
    got = [r.split(": ", 1)[1] for r in findings(str(py)) + findings(str(c))]
    assert got == ["cites a VM: 'VM'", "cites an issue number: 'issue 31'",
                   "cites a work session: 'this session'",
                   "cites a path outside the repository: '../shared/'",
                   "cites a VM: 'vCPU'", "cites a VM: 'VM'",
                   "cites an issue number: 'issue #12'"]
    assert [r.split(":")[1] for r in findings(str(c))] == ["1", "1", "3"]


def test_the_settings_registry_names_files_that_exist():
    """Each setting's ``read_in`` (the maintainers' table in docs/configuration.md) names
    files of the tree as it is."""
    from collectives import config
    missing = []
    for s in config.SETTINGS:
        for part in re.split(r",\s*|\s*->\s*", s.read_in):
            path = part.split(" ")[0]
            if path and not any(os.path.exists(os.path.join(top, path))
                                for top in (PKG, ROOT)):
                missing.append(f"{s.name}: {path}")
    assert missing == []
