"""The TCP transport's wire: versioned little-endian frames, call fingerprints, checked p2p.

Properties:

* a frame header is 48 little-endian bytes in a fixed layout, whatever the host's byte
  order, and decodes to what was encoded;
* a peer speaking another wire version is refused at connect, with DistNetworkError on
  both sides;
* a point-to-point receive of a different size or dtype than the message raises
  DistBackendError naming both, for a named source and for any source, and leaves the
  group usable;
* ranks started with contradicting algorithm settings use rank 0's and get correct results;
* ranks that call mismatched collectives (the nine cases of issue 28 and more) all raise
  DistBackendError naming both calls (collectives.core.fingerprint.mismatch_message), at that
  call, on "gloo-tcp" and on the hierarchical mode's inter-host level; the group then
  says it is unusable; ranks that only send learn of it from the others' abort frames.
"""
import os
import struct
from datetime import timedelta

import numpy as np
import pytest

pytest.importorskip("collectives.engines._tcp", reason="collectives.engines._tcp is not built")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from collectives.engines import _tcp  # noqa: E402
from collectives.core import dtypes as D  # noqa: E402
from collectives.core import fingerprint as F  # noqa: E402
from tests.support.profiles import examples  # noqa: E402
from tests.support.ranks import available_configs, backend_pool, error_text, get_pool  # noqa: E402

GROUP_TIMEOUT_S = 60  # longer than a pool call: a rank left waiting fails the test, not slowly
CALL_TIMEOUT_S = 45
WIRE = struct.Struct("<HBBBBHIiQQQQ")  # the header's fields, little-endian


# ---- the header -----------------------------------------------------------------------

@settings(max_examples=examples(60), deadline=None)
@given(ftype=st.integers(0, 255), kind=st.integers(0, 255), dtype=st.integers(0, 255),
       group=st.integers(0, 2**32 - 1), tag=st.integers(-2**31, 2**31 - 1),
       seq=st.integers(0, 2**64 - 1), fp=st.integers(0, 2**64 - 1), aux=st.integers(0, 2**64 - 1),
       length=st.integers(0, 2**64 - 1))
def test_a_frame_header_is_48_little_endian_bytes_that_decode_to_what_was_encoded(
        ftype, kind, dtype, group, tag, seq, fp, aux, length):
    raw = _tcp.wire_header(ftype, kind, dtype, group, tag, seq, fp, aux, length)
    expected = WIRE.pack(0xC011, _tcp.WIRE_VERSION, ftype, kind, dtype, 0, group, tag, seq, fp, aux,
                         length)
    assert raw == expected and len(raw) == _tcp.HEADER_BYTES == 48
    fields = _tcp.parse_wire_header(raw)
    assert fields == WIRE.unpack(expected)
    assert dict(zip(_tcp.HEADER_FIELDS, fields))["fp"] == fp


def test_the_wire_version_is_2_and_the_byte_dtype_is_the_fingerprints():
    assert _tcp.WIRE_VERSION == 2  # 1 was the native-endian header without version
    assert _tcp.NO_DTYPE == F.NO_DTYPE


# ---- ranks driving the backend directly -------------------------------------------------

def _setup(ctx):
    from collectives.store import TCPStore
    ctx.state["store"] = TCPStore("127.0.0.1", ctx.port, ctx.world_size, ctx.rank == 0,
                                  timedelta(seconds=60))


def _pool(n):
    return get_pool(n, setup=_setup, env={"TCP_WIRE_TEST": "1"})


def _buf(dtype, arr):
    from collectives.core.tensors import Buffer
    return Buffer(arr.__array_interface__["data"][0], arr.size, dtype, -1, arr)


def test_a_socket_buffer_above_the_kernels_cap_is_left_to_the_kernels_tuning(monkeypatch):
    """A buffer set explicitly stops the kernel's tuning and is cut to net.core.*mem_max:
    the transport sets it only where the kernel allows the size asked for."""
    import socket

    from collectives.backends.tcp import mesh
    want = 1 << 20
    cases = (({"wmem_max": 4 << 20, "rmem_max": 4 << 20}, (True, True)),
             ({"wmem_max": 212992, "rmem_max": 4 << 20}, (False, True)),
             ({"wmem_max": 4 << 20, "rmem_max": 212992}, (True, False)),
             ({}, (True, True)))  # caps unknown (not Linux): set as asked
    class Spy:
        """A socket that records the buffer options set on it."""
        def __init__(self, sock):
            self.sock, self.set = sock, []

        def setsockopt(self, level, opt, value):
            if level == socket.SOL_SOCKET:
                self.set.append((opt, value))
            self.sock.setsockopt(level, opt, value)

    for caps, expect_set in cases:
        monkeypatch.setattr(mesh, "_kernel_cap", caps.get)
        with socket.socket() as sock:
            spy = Spy(sock)
            mesh._tune_socket(spy, want)
        set_opts = spy.set
        got = (any(o == socket.SO_SNDBUF for o, _ in set_opts),
               any(o == socket.SO_RCVBUF for o, _ in set_opts))
        assert got == expect_set, caps
        assert all(v == want for _, v in set_opts)


def connect_with_version(ctx, name, versions):
    from collectives.backends.tcp import connect_mesh
    from collectives.core.errors import DistNetworkError
    from collectives.store import PrefixStore
    try:
        fds, _ = connect_mesh(PrefixStore(name, ctx.state["store"]), ctx.rank, ctx.world_size, 15.0,
                              version=versions[ctx.rank])
    except DistNetworkError as e:
        return str(e)
    for fd in fds:
        if fd >= 0:
            os.close(fd)
    return None


@pytest.mark.timeout(120)
def test_a_peer_speaking_another_wire_version_is_refused_at_connect_on_both_sides():
    got = _pool(2).run(connect_with_version, "v99", [None, 99], timeout=60)
    for me, msg in enumerate(got):
        assert msg is not None and "different wire protocol versions" in msg, got
        assert f"rank {me}: {[_tcp.WIRE_VERSION, 99][me]})" in msg, got
        assert f": {[99, _tcp.WIRE_VERSION][me]}, rank {me}" in msg, got
    # the same versions connect
    assert _pool(2).run(connect_with_version, "vsame", [None, None], timeout=60) == [None, None]


def contradicting_settings(ctx, name, env):
    """Each rank's environment names other thresholds; every result must still be right and
    every rank must use rank 0's."""
    from collectives.backends.tcp import TcpBackend
    from collectives.store import PrefixStore
    from tests.support.environ import environ
    with environ(env[ctx.rank]):
        b = TcpBackend(PrefixStore(name, ctx.state["store"]), ctx.rank, ctx.world_size, 30.0)
    n, r = ctx.world_size, ctx.rank
    ok = True
    try:
        for count in (1, 5, 16, 40, 100, 1000, 5000, 70000):
            x = np.full(count, r + 1, np.int64)
            b.all_reduce(_buf(D.INT64, x), D.SUM)
            ok &= bool((x == n * (n + 1) // 2).all())
            y = np.full(count, r, np.float32)
            b.broadcast(_buf(D.FLOAT32, y), count % n)
            ok &= bool((y == count % n).all())
            z = np.full(count, r, np.int32)
            b.reduce(_buf(D.INT32, z), D.MAX, (count + 1) % n)
            ok &= bool(r != (count + 1) % n or (z == n - 1).all())
            out = np.zeros(count * n, np.int16)
            b.all_gather(_buf(D.INT16, out), _buf(D.INT16, np.full(count, r, np.int16)))
            ok &= bool((out == np.repeat(np.arange(n), count)).all())
        return ok, b.tuning()
    finally:
        b.shutdown()


@pytest.mark.timeout(240)
def test_ranks_with_contradicting_algorithm_settings_use_rank_0s_and_get_correct_results():
    small = {"COLLECTIVES_TCP_RD_MAX": "8", "COLLECTIVES_TCP_TREE_MAX": "8", "COLLECTIVES_TCP_SEGMENT": "64",
             "COLLECTIVES_TCP_DIRECT_MAX": "8", "COLLECTIVES_TCP_DIRECT_WORLD": "1"}
    big = {"COLLECTIVES_TCP_RD_MAX": "1000000", "COLLECTIVES_TCP_TREE_MAX": "1000000",
           "COLLECTIVES_TCP_SEGMENT": "100000", "COLLECTIVES_TCP_DIRECT_MAX": "1000000",
           "COLLECTIVES_TCP_DIRECT_WORLD": "8"}
    for env in ([small, big, big], [big, small, {}]):
        got = _pool(3).run(contradicting_settings, f"mixed{len(env[2])}", env, timeout=180)
        assert all(ok for ok, _ in got), got
        tunings = [t for _, t in got]
        agreed = ("allreduce_rd_max", "tree_max", "segment", "direct_max", "allreduce_direct_world",
                  "seg_split")
        for name in agreed:
            assert len({t[name] for t in tunings}) == 1, (name, tunings)
        assert tunings[0]["tree_max"] == int(env[0]["COLLECTIVES_TCP_TREE_MAX"])


def dissemination_abort(ctx, name):
    """Fingerprint frames in dissemination rounds (fp_direct_world 1), world 4: rank 1
    broadcasts a different count. The root hears directly only from ranks 2 and 3, which
    match it: it learns of the mismatch from the abort frames of the ranks that saw it."""
    from collectives.backends.tcp import TcpBackend
    from collectives.core.errors import DistBackendError
    from collectives.store import PrefixStore
    b = TcpBackend(PrefixStore(name, ctx.state["store"]), ctx.rank, ctx.world_size,
                   float(GROUP_TIMEOUT_S), {"fp_direct_world": 1})
    try:
        b.barrier()
        x = np.arange(10 if ctx.rank == 1 else 8, dtype=np.float32)
        err = after = None
        try:
            b.broadcast(_buf(D.FLOAT32, x), 0)
        except DistBackendError as e:
            err = error_text(e)
        try:
            b.barrier()
        except DistBackendError as e:
            after = error_text(e)
        return err, after
    finally:
        b.shutdown()


@pytest.mark.timeout(120)
def test_the_abort_frame_reaches_a_root_that_only_sends():
    got = _pool(4).run(dissemination_abort, "abort", timeout=CALL_TIMEOUT_S)
    for r, (err, after) in enumerate(got):
        assert err is not None, f"rank {r} returned silently: {got}"
        assert "broadcast(src=0, float32, 10)" in err and "broadcast(src=0, float32, 8)" in err, err
        assert "as collective #2" in err, err
        assert after is not None and "group unusable after an earlier failure" in after, after
    assert len({err for err, _ in got}) == 1, got  # every rank names the same pair


def p2p_mismatch(ctx, name):
    from collectives.backends.tcp import TcpBackend
    from collectives.core.errors import DistBackendError
    from collectives.store import PrefixStore
    b = TcpBackend(PrefixStore(name, ctx.state["store"]), ctx.rank, ctx.world_size, 30.0)
    out = []
    try:
        cases = [  # (what rank 0 sends, what rank 1 receives into, source)
            (np.arange(4, dtype=np.float32), np.zeros(4, np.int32), 0),      # dtype
            (np.arange(4, dtype=np.float32), np.zeros(5, np.float32), 0),    # longer buffer: fits
            (np.arange(6, dtype=np.float32), np.zeros(5, np.float32), None),  # shorter, any source
            (np.arange(3, dtype=np.int64), np.zeros(3, np.int64), None),     # equal: works
        ]
        codes = {np.dtype(np.float32): D.FLOAT32, np.dtype(np.int32): D.INT32, np.dtype(np.int64): D.INT64}
        for k, (sent, into, src) in enumerate(cases):
            if ctx.rank == 0:
                b.isend(_buf(codes[sent.dtype], sent), 1, 40 + k).wait()
                out.append(None)
            else:
                try:
                    req = b.irecv(_buf(codes[into.dtype], into), src, 40 + k)
                    req.wait()
                    out.append(("ok", into.tolist(), req.source))
                except DistBackendError as e:
                    out.append(("err", str(e), into.tolist()))
        x = np.ones(3, np.float32)
        b.all_reduce(_buf(D.FLOAT32, x), D.SUM)  # the group is still usable
        return out, x.tolist()
    finally:
        b.shutdown()


@pytest.mark.timeout(120)
def test_a_p2p_receive_of_a_longer_message_or_another_dtype_raises_naming_both():
    """A receive's size is an upper bound (MPI's and torch gloo's rule): a shorter message
    fills its start; a longer one is refused, never truncated; another dtype is refused."""
    got = _pool(2).run(p2p_mismatch, "p2p", timeout=60)
    res, summed = got[1]
    assert summed == [2.0, 2.0, 2.0]
    (s0, m0, b0), (s1, b1, src1), (s2, m2, b2), ok = res
    assert s0 == "err" and "4 x float32 (16 bytes)" in m0 and "4 x int32 (16 bytes)" in m0, m0
    assert s1 == "ok" and b1 == [0.0, 1.0, 2.0, 3.0, 0.0] and src1 == 0, (s1, b1)
    assert s2 == "err" and "6 x float32" in m2 and "5 x float32" in m2 and "any rank" in m2, m2
    assert b0 == [0] * 4 and b2 == [0.0] * 5  # nothing reinterpreted, nothing truncated
    assert ok == ("ok", [0, 1, 2], 0)


# ---- mismatched collectives through the front end --------------------------------------

# the nine cases of issue 28's table: (name, most ranks' call, the odd rank's call)
from tests.diagnostics.test_mismatch import NINE  # noqa: E402

MORE = [
    ("scatter_root", dict(kind="scatter", dtype="float64", count=9, root=0),
     dict(kind="scatter", dtype="float64", count=9, root=1)),
    ("gather_count", dict(kind="gather", dtype="int16", count=9, root=1),
     dict(kind="gather", dtype="int16", count=8, root=1)),
    ("reduce_op", dict(kind="reduce", dtype="int32", count=9, root=1, op="SUM"),
     dict(kind="reduce", dtype="int32", count=9, root=1, op="BXOR")),
    ("large_broadcast", dict(kind="broadcast", dtype="uint8", count=1 << 20, root=0),
     dict(kind="broadcast", dtype="uint8", count=(1 << 20) + 64, root=0)),
    ("barrier_vs_all_gather", dict(kind="barrier"), dict(kind="all_gather", dtype="float32", count=4)),
    ("all_to_all_dtype", dict(kind="all_to_all", dtype="float32", count=3),
     dict(kind="all_to_all", dtype="int32", count=3)),
]
# the hierarchical mode sends gather, scatter and all_to_all over another TCP group than the
# rest (its whole-group one), after comparing the call within hosts and among leaders: a
# mismatch found in that group numbers the call by its count ("#" only is checked) and
# leaves the other usable
HIER_WHOLE_GROUP = {"gather", "scatter", "all_to_all"}


def _call(dist, grp, spec, me, n):
    kind = spec["kind"]
    if kind == "barrier":
        return dist.barrier(group=grp)
    dt, cnt, root = np.dtype(spec["dtype"]), spec["count"], spec.get("root", 0) % n
    op = getattr(dist.ReduceOp, spec.get("op", "SUM"))
    x = np.full(cnt, me + 3, dt)
    if kind == "all_to_all":
        dist.all_to_all_single(np.zeros(cnt * n, dt), np.full(cnt * n, me, dt), group=grp)
    elif kind == "all_reduce":
        dist.all_reduce(x, op=op, group=grp)
    elif kind == "broadcast":
        dist.broadcast(x, root, group=grp)
    elif kind == "reduce":
        dist.reduce(x, root, op=op, group=grp)
    elif kind == "gather":
        dist.gather(x, [np.zeros(cnt, dt) for _ in range(n)] if me == root else None, root, group=grp)
    elif kind == "scatter":
        dist.scatter(x, [np.full(cnt, q, dt) for q in range(n)] if me == root else None, root, group=grp)
    elif kind == "all_gather":
        dist.all_gather([np.zeros(cnt, dt) for _ in range(n)], x, group=grp)
    else:
        raise ValueError(kind)


def mismatch_case(ctx, specs):
    """Run on every rank: a fresh group, one matched all_reduce, then specs[rank]; returns
    (error of that call, error of a barrier after it)."""
    import collectives as dist
    from collectives.core.errors import DistBackendError
    n, me = ctx.world_size, ctx.rank
    grp = dist.new_group(list(range(n)), timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        dist.all_reduce(np.ones(1, np.float32), group=grp)
        err = after = None
        try:
            _call(dist, grp, specs[me], me, n)
        except DistBackendError as e:
            err = error_text(e)
        try:
            dist.barrier(group=grp)
        except DistBackendError as e:
            after = error_text(e)
        return err, after
    finally:
        dist.destroy_process_group(grp)


def _describe(spec, n):
    kind = spec["kind"]
    code = {"barrier": F.BARRIER, "broadcast": F.BROADCAST, "all_reduce": F.ALL_REDUCE,
            "reduce": F.REDUCE, "gather": F.GATHER, "scatter": F.SCATTER,
            "all_gather": F.ALL_GATHER, "all_to_all": F.ALL_TO_ALL}[kind]
    if kind == "barrier":
        return F.describe(code)
    if kind == "all_to_all":  # per-peer counts differ legally: the word names kind and dtype
        return F.describe(code, {v: k for k, v in D.DTYPE_NAMES.items()}[spec["dtype"]])
    dtype = {v: k for k, v in D.DTYPE_NAMES.items()}[spec["dtype"]]
    op = getattr(D, spec.get("op", "SUM")) if kind in ("all_reduce", "reduce") else -1
    root = spec.get("root", 0) % n if kind in ("broadcast", "reduce", "gather", "scatter") else -1
    return F.describe(code, dtype, spec["count"], root, op)


def _check_all_raised(got, common, odd, n, seq="#2", after_too=True):
    mine, theirs = _describe(common, n), _describe(odd, n)
    for r, (err, after) in enumerate(got):
        assert err is not None, f"rank {r} returned silently: {got}"
        assert mine in err and theirs in err and f"as collective {seq}" in err, (r, err)
        if after_too:
            assert after is not None and "group unusable after an earlier failure" in after, (r, after)
    assert len({err for err, _ in got}) == 1, got  # every rank names the same pair


TCP_CONFIGS = [c for c in ("gloo-tcp", "gloo-hier") if c in available_configs()]
CONFIGS = TCP_CONFIGS  # the shared config fixture (conftest.py) takes these


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,common,odd", NINE + MORE, ids=[c[0] for c in NINE + MORE])
def test_a_mismatched_collective_raises_on_every_rank_naming_both_calls(config, name, common, odd):
    # world 2 (on gloo-hier: one rank per faked host, so the inter-host level); world 3 on
    # gloo-tcp, the odd rank last, so trees and rounds reach it through another rank
    worlds = (2,) if config == "gloo-hier" else (2, 3)
    for n in worlds:
        specs = [common] * (n - 1) + [odd]
        got = backend_pool(config, n).run(mismatch_case, specs, timeout=CALL_TIMEOUT_S)
        whole = config == "gloo-hier" and common["kind"] in HIER_WHOLE_GROUP
        _check_all_raised(got, common, odd, n, seq="#" if whole else "#2", after_too=not whole)


def legal_after_mismatch(ctx):
    """Matched calls of every rooted kind, on every root, in a fresh group: the fingerprint
    frames never fail a legal call (reshaped inputs with equal counts included)."""
    import collectives as dist
    n, me = ctx.world_size, ctx.rank
    grp = dist.new_group(list(range(n)), timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        ok = True
        for root in range(n):
            x = np.full(6, me, np.float32).reshape((2, 3) if me % 2 else (6,))
            dist.broadcast(x, root, group=grp)
            ok &= bool((x == root).all())
            y = np.full(4, me + 1, np.int64)
            dist.reduce(y, root, group=grp)
            ok &= bool(me != root or (y == n * (n + 1) // 2).all())
            outs = [np.zeros(2, np.int32) for _ in range(n)] if me == root else None
            dist.gather(np.full(2, me, np.int32), outs, root, group=grp)
            ok &= bool(me != root or all((o == q).all() for q, o in enumerate(outs)))
            z = np.zeros(3, np.float64)
            dist.scatter(z, [np.full(3, q, np.float64) for q in range(n)] if me == root else None,
                         root, group=grp)
            ok &= bool((z == me).all())
        return ok
    finally:
        dist.destroy_process_group(grp)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_matched_rooted_collectives_still_work(config, n):
    assert all(backend_pool(config, n).run(legal_after_mismatch, timeout=CALL_TIMEOUT_S))


def a2a_split_case(ctx, odd):
    """Run on every rank: all_to_all_single of 3 float32 to every rank, except that rank odd
    sends 4 to rank 0; returns (error of that call, error of a barrier after it)."""
    import collectives as dist
    from collectives.core.errors import DistBackendError
    n, me = ctx.world_size, ctx.rank
    grp = dist.new_group(list(range(n)), timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        dist.all_reduce(np.ones(1, np.float32), group=grp)
        send = [3 + (q == 0 and me == odd) for q in range(n)]
        err = after = None
        try:
            dist.all_to_all_single(np.zeros(3 * n, np.float32), np.full(sum(send), me, np.float32),
                                   [3] * n, send, group=grp)
        except DistBackendError as e:
            err = error_text(e)
        try:
            dist.barrier(group=grp)
        except DistBackendError as e:
            after = error_text(e)
        return err, after
    finally:
        dist.destroy_process_group(grp)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3])
def test_an_all_to_all_split_that_differs_raises_at_both_ends_and_poisons_the_group(n):
    """The pair whose splits differ raises the same words at the call; a rank outside the
    pair got what it expected and may return, but its next call raises."""
    if "gloo-tcp" not in available_configs():
        pytest.skip("gloo-tcp is not available")
    odd = n - 1
    got = backend_pool("gloo-tcp", n).run(a2a_split_case, odd, timeout=CALL_TIMEOUT_S)
    words = (f"rank {odd} sends 4 x float32 (16 bytes) to rank 0, which expects 3 x float32 "
             f"(12 bytes)")
    for r in (0, odd):
        assert got[r][0] is not None and words in got[r][0], got
    assert got[0][0] == got[odd][0], got
    # every rank that raised in the call raised the pair's words, not a report of them
    # relayed through another rank (a race that once made rank 2 raise "rank 1 reported:
    # all_to_all #2 failed on rank 1: rank 0 reported: ...")
    for r in range(n):
        assert got[r][0] is None or got[r][0] == got[0][0], (r, got)
    for r, (_, after) in enumerate(got):
        # the next call raises, naming the pair's split (the group's own record, or, on a
        # rank whose barrier was under way when the pair's abort frame came, the verdict)
        assert after is not None and ("group unusable after an earlier failure" in after
                                      and words in after), (r, got)

