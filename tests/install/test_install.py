"""The package as installed: one version, and a wheel that holds the package and nothing
else, its extensions stripped. The wheel's own checks run where collectives was installed
from a wheel (.ci/run's installed leg); an editable install skips them, saying so."""
import importlib.metadata
import json
import os
import re
import struct

import pytest

import collectives
from collectives import config
from tests.support import ROOT, installed_checkout
from tests.support.requires import needs_source_tree

DIST = importlib.metadata.distribution("collectives")


def _from_wheel():
    """Whether the collectives imported here is the one a wheel installed (not an editable
    install, nor a checkout whose build left an .egg-info beside it)."""
    if DIST.read_text("WHEEL") is None:
        return False
    direct = DIST.read_text("direct_url.json")
    if direct and json.loads(direct).get("dir_info", {}).get("editable", False):
        return False
    init = DIST.locate_file("collectives/__init__.py")
    return os.path.realpath(str(init)) == os.path.realpath(collectives.__file__)


# in .ci/run's installed leg these must run: there they fail rather than skip
from_wheel = pytest.mark.skipif(
    not _from_wheel() and not installed_checkout(),
    reason="not installed from a wheel (.ci/run's installed leg checks the wheel)")


def test_the_version_is_the_package_metadatas():
    assert collectives.__version__ == importlib.metadata.version("collectives")
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)*", collectives.__version__)
    pyproject = os.path.join(ROOT, "pyproject.toml")
    if os.path.exists(pyproject):  # the one place it is written
        with open(pyproject) as f:
            declared = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)
        assert collectives.__version__ == declared


def test_the_console_scripts_are_declared():
    scripts = {e.name: e.value for e in DIST.entry_points if e.group == "console_scripts"}
    assert scripts == {"collectives-run": "collectives.run:main",
                       "collectives-trace": "collectives.diagnostics.trace:main",
                       "collectives-info": "collectives.diagnostics.envreport:main"}


def _files():
    return [str(f) for f in DIST.files]


@from_wheel
def test_the_wheel_holds_the_package_its_stubs_and_the_license():
    files = _files()
    pkg = [f for f in files if not f.startswith("collectives-")]
    assert all(f.startswith("collectives/") or f.startswith("../") or f.endswith(".pyc")
               or "/bin/" in f for f in pkg), [f for f in pkg if not f.startswith("collectives/")]
    assert not [f for f in files if re.search(r"(^|/)(tests|bench|examples|docs)/", f)]
    assert not [f for f in files if f.endswith((".pyx", ".pxi", ".c", ".h"))]
    assert "collectives/py.typed" in files
    for stub in ("engines/_core.pyi", "engines/_shm.pyi", "engines/_tcp.pyi", "engines/_buffer.pyi",
                 "engines/_buffer.pxd", "store/rendezvous.pyi",
                 "store/__init__.pyi"):
        assert f"collectives/{stub}" in files
    assert any(f.endswith("LICENSE") and ".dist-info/" in f for f in files)
    exts = [f for f in files if f.endswith(".so")]
    assert sorted(os.path.basename(f).split(".")[0] for f in exts) == sorted(config.EXTENSIONS)


@from_wheel
def test_the_wheel_carries_a_manylinux_tag():
    tags = [line.split(": ", 1)[1] for line in DIST.read_text("WHEEL").splitlines()
            if line.startswith("Tag: ")]
    assert tags and all(re.fullmatch(r"cp\d+-cp\d+-manylinux_\d+_\d+_\w+", t) for t in tags), tags


def _sections(path):
    """Section names of an ELF64 little-endian shared object."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, path
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = headers[shstrndx][4]
    return {data[strtab_off + h[0]:data.index(b"\0", strtab_off + h[0])].decode()
            for h in headers}


@from_wheel
def test_the_extensions_are_stripped():
    for f in _files():
        if f.endswith(".so"):
            names = _sections(DIST.locate_file(f))
            assert ".symtab" not in names, f
            assert not [n for n in names if n.startswith(".debug")], f
            assert ".dynsym" in names  # its exports stay (PyInit_*)


@needs_source_tree
def test_the_first_program_in_the_docs_is_the_example_file():
    """docs/getting-started.md shows examples/numpy_allreduce.py as it is."""
    with open(os.path.join(ROOT, "docs", "getting-started.md")) as f:
        page = f.read()
    with open(os.path.join(ROOT, "examples", "numpy_allreduce.py")) as f:
        program = f.read()
    shown = page.split("(`examples/numpy_allreduce.py`):", 1)[1].split("```python\n", 1)[1]
    shown = shown.split("```", 1)[0]
    assert shown in program and shown.startswith("import numpy as np")
    assert program.endswith(shown)
