"""One catalogue of collectives (``collectives.core.fingerprint.COLLECTIVES``), and every
list of them tied to it:

- the backend contract: ``Backend`` has a method for each collective (all_gather_list
  aside, which is optional) that raises NotImplementedError, and no other such method but
  isend and irecv;
- the op table: the backend methods its entries name are the catalogue's (with isend and
  irecv), every one of them named, and each entry's fingerprint kind is its method's;
- the shm backend forwards each collective of the catalogue, bound in a slot of its name
  (its class says so in its source; an instance holds ShmComm's methods);
- the DETAIL checks' forwarders: one per collective, comparing fingerprints under the
  catalogue's kind codes, then calling the wrapped backend;
- the TCP engine: ``_tcp.KINDS`` (what its collectives take) and the C engine's frame kinds
  (``K_*`` and ``KNAMES`` in src/tcp) are the fingerprint's codes and names;
- the fingerprint's codes are distinct and name themselves in ``KIND_NAMES``.
"""
import ast
import inspect
import os
import re

import numpy as np
import pytest

from collectives.api import opspec
from collectives.backends import shm as shm_mod
from collectives.backends.base import Backend
from collectives.core import fingerprint as F
from collectives.core.convert import buffer
from tests.support import ROOT

COLLECTIVES = F.COLLECTIVES
CONTRACT = [name for name in COLLECTIVES if name != "all_gather_list"]


def _raises_not_implemented(fn):
    src = inspect.getsource(fn)
    return "raise NotImplementedError" in src


def test_the_kind_codes_are_distinct_and_named():
    codes = [F.BARRIER, F.BROADCAST, F.ALL_REDUCE, F.REDUCE, F.ALL_GATHER, F.GATHER, F.SCATTER,
             F.REDUCE_SCATTER, F.ALL_TO_ALL, F.SEND, F.RECV]
    assert len(set(codes)) == len(codes) and set(codes) == set(F.KIND_NAMES)
    assert all(0 < c < 16 for c in codes)  # the packed word's 4 bits
    for name, code in COLLECTIVES.items():
        assert F.KIND_NAMES[code] == ("all_gather" if name == "all_gather_list" else name)
    assert set(F.KIND_NAMES.values()) == set(CONTRACT) | {"send", "recv"}


def test_the_backend_contract_is_the_catalogue():
    stubs = {name for name, fn in vars(Backend).items()
             if inspect.isfunction(fn) and _raises_not_implemented(fn)}
    assert stubs == set(CONTRACT) | {"isend", "irecv"}


def test_the_op_table_names_the_catalogues_methods():
    methods = {spec.method for spec in opspec.SPECS.values()}
    assert methods == set(CONTRACT) | {"isend", "irecv"}
    for spec in opspec.SPECS.values():
        if spec.peer is None:
            assert spec.fingerprint == COLLECTIVES[spec.method], spec
    # all_gather_list: the plan of all_gather calls it where the backend gathers into lists
    assert "all_gather_list" in inspect.getsource(opspec._all_gather)


def test_shm_forwards_every_collective_in_a_slot_of_its_name():
    cls = shm_mod.ShmBackend
    assert shm_mod._FORWARDED == tuple(COLLECTIVES)
    assert set(COLLECTIVES) <= set(cls.__slots__)
    # each bound by name in __init__: ``self.NAME = comm.NAME``
    init = ast.parse(inspect.getsource(cls)).body[0]
    init = next(n for n in init.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    bound = {t.targets[0].attr: t.value for t in ast.walk(init)
             if isinstance(t, ast.Assign) and len(t.targets) == 1
             and isinstance(t.targets[0], ast.Attribute)
             and isinstance(t.targets[0].value, ast.Name) and t.targets[0].value.id == "self"}
    for name in COLLECTIVES:
        value = bound.get(name)
        assert isinstance(value, ast.Attribute) and value.attr == name, name
        assert isinstance(value.value, ast.Name) and value.value.id == "comm", name


@pytest.mark.skipif(not shm_mod.shm_available(), reason="the _shm extension is not built here")
def test_a_shm_backend_holds_its_comms_methods():
    from collectives.store import HashStore
    be = shm_mod.ShmBackend(HashStore(), 0, 1, 30.0)
    try:
        for name in COLLECTIVES:
            fn = getattr(be, name)
            assert fn.__self__ is be._comm and fn.__name__ == name, name
        x = np.arange(4, dtype=np.float32)
        be.all_reduce(buffer(x), 0)  # a world of one: the sum is the input
        assert x.tolist() == [0, 1, 2, 3]
    finally:
        be.shutdown()


def test_the_detail_checks_forward_every_collective():
    from collectives.diagnostics.debug import CheckedBackend, _FINGERPRINTED
    assert list(_FINGERPRINTED) == list(COLLECTIVES)
    seen = []

    class Inner:
        size = 1

        def all_gather(self, out, inp):  # a world of one: the rows are this rank's
            row = np.asarray(inp.obj)
            if row.dtype == np.int64:  # the check's fingerprint row (not the forwarded call)
                seen.append(row.copy())
            np.asarray(out.obj).reshape(-1)[:row.size] = row.reshape(-1)

        def __getattr__(self, name):
            return lambda *args: ("called", name, args)

    be = CheckedBackend(Inner(), "g")
    buf = buffer(np.zeros(3, np.float32))
    args = {"broadcast": (buf, 0), "all_reduce": (buf, 0), "reduce": (buf, 0, 0),
            "all_gather": (buf, buf), "all_gather_list": ([buf], buf), "gather": (buf, buf, 0),
            "scatter": (buf, buf, 0), "reduce_scatter": (buf, buf, 0),
            "all_to_all": (buf, buf, [3], [3]), "barrier": ()}
    assert set(args) == set(COLLECTIVES)
    for name, code in COLLECTIVES.items():
        got = getattr(be, name)(*args[name])
        if name != "all_gather":  # (the check's own all_gather is Inner's)
            assert got == ("called", name, args[name])
        assert seen[-1][1] == code, name  # the row carries the catalogue's kind code
        assert getattr(CheckedBackend, name).__name__ == name


def test_the_tcp_engine_takes_the_catalogues_kind_codes():
    _tcp = pytest.importorskip("collectives.engines._tcp", reason="the _tcp extension is not built here")
    assert _tcp.KINDS == {name: code for name, code in COLLECTIVES.items()
                          if name != "all_gather_list"}


def _tcp_source(name):
    for dp, _, fs in os.walk(os.path.join(ROOT, "collectives")):
        if name in fs and os.path.basename(dp) == "tcp":
            with open(os.path.join(dp, name)) as f:
                return f.read()
    pytest.skip(f"{name} is not in this tree (an installed package)")


def test_the_c_engines_frame_kinds_are_the_fingerprints():
    header = _tcp_source("tcp_internal.h")
    body = re.search(r"enum\s*\{\s*(K_BARRIER\s*=\s*1[^}]*)\}", header).group(1)
    names = [n.split("=")[0].strip() for n in body.split(",")]
    assert names[:9] == ["K_BARRIER", "K_BROADCAST", "K_ALLREDUCE", "K_REDUCE", "K_ALLGATHER",
                         "K_GATHER", "K_SCATTER", "K_REDUCE_SCATTER", "K_ALLTOALL"]
    # K_BARRIER = 1, then one more each: the fingerprint's codes in its order
    assert [F.BARRIER + i for i in range(9)] == [F.BARRIER, F.BROADCAST, F.ALL_REDUCE, F.REDUCE,
                                                F.ALL_GATHER, F.GATHER, F.SCATTER,
                                                F.REDUCE_SCATTER, F.ALL_TO_ALL]
    knames = re.search(r"KNAMES\[K_NKINDS\]\s*=\s*\{([^}]*)\}", _tcp_source("tcp_transport.c"))
    words = re.findall(r'"([^"]*)"', knames.group(1))
    assert words[1:10] == [F.KIND_NAMES[c] for c in range(F.BARRIER, F.ALL_TO_ALL + 1)]
