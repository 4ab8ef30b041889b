"""The flight recorder's ring of collectives: ``collectives.engines._core.CallRing`` (C arrays) and
``flight_recorder._PyCallRing`` (the package without its extensions) keep the same
entries, and a recorder with stacks (COLLECTIVES_FR_STACK=1) records the caller's.

Property: after any sequence of issued calls, both rings hold exactly the last ``size``
entries, oldest first, with what was issued and issue times in call order.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.support.profiles import examples
from tests.support.ranks import ROOT, free_port
from tests.support.requires import needs_gloo


def _rings():
    from collectives.diagnostics import flight_recorder as fr
    out = [pytest.param(fr._PyCallRing, id="python")]
    try:
        from collectives.engines._core import CallRing
    except ImportError:
        out.append(pytest.param(None, id="c", marks=pytest.mark.skip(reason="_core not built")))
    else:
        out.append(pytest.param(CallRing, id="c"))
    return out


@pytest.mark.parametrize("ring", _rings())
def test_the_ring_keeps_the_last_calls_as_issued(ring):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from collectives.core.tensors import empty_like_buffer

    call = st.tuples(st.sampled_from(["all_reduce", "broadcast", "barrier"]),
                     st.integers(0, 2**40), st.integers(-1, 11), st.integers(-1, 4095),
                     st.integers(-1, 7), st.booleans())

    @settings(max_examples=examples(60), deadline=None)
    @given(st.integers(1, 6), st.lists(call, max_size=20))
    def check(size, calls):
        r = ring(size)
        assert (r.seq, r.size) == (0, size)
        assert r.entries() == [] and r.entry(0) is None and r.entry(1) is None
        t0 = time.monotonic_ns()
        want = []
        for s, (kind, count, dtype, root, op, as_buffer) in enumerate(calls, 1):
            if as_buffer and dtype >= 0 and count < 64:
                got = r.issue_buffer(kind, empty_like_buffer(count, dtype), root, op)
            else:
                got = r.issue(kind, count, dtype, root, op)
            assert got == s == r.seq
            want.append((s, kind, count, dtype, root, op))
        t1 = time.monotonic_ns()
        kept = want[-size:] if want else []
        entries = r.entries()
        assert [e[:6] for e in entries] == kept
        assert [r.entry(e[0]) for e in entries] == entries
        times = [e[6] for e in entries]
        assert times == sorted(times) and all(t0 <= t <= t1 for t in times)
        assert all(r.entry(s) is None for s in range(1, len(want) - size + 1))
        assert r.entry(len(want) + 1) is None

    check()


@pytest.mark.parametrize("ring", _rings())
def test_a_stack_function_is_called_once_per_call_and_its_result_kept(ring):
    from collectives.core.tensors import empty_like_buffer
    calls = []
    r = ring(2, stack=lambda: calls.append(1) or len(calls))
    r.issue_buffer("broadcast", empty_like_buffer(3, 2), 1)
    r.issue("barrier")
    assert r.entries()[0][:6] == (1, "broadcast", 3, 2, 1, -1)
    assert [e[7] for e in r.entries()] == [1, 2] and r.seq == 2
    with pytest.raises(ValueError):
        ring(0)


STACK_SCRIPT = """
import json, sys, numpy as np
import collectives as dist
dist.init_process_group("gloo", rank=0, world_size=1)
def users_function():
    dist.broadcast(np.ones(2, np.float32), src=0)
users_function()
dist.all_reduce(np.ones(2, np.float32))
path = dist.dump_flight_recorder(sys.argv[1])
print(json.dumps(json.load(open(path))["groups"]["default_pg"]["entries"]))
dist.destroy_process_group()
"""


@needs_gloo
@pytest.mark.timeout(120)
def test_with_stacks_each_entry_holds_the_callers_frames(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(STACK_SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT, COLLECTIVES_FR_STACK="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "d")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr
    entries = json.loads(p.stdout.splitlines()[-1])
    assert [e["call"] for e in entries] == ["broadcast(src=0, float32, 2)",
                                            "all_reduce(float32, 2, op=SUM)"]
    first, second = (e["stack"] for e in entries)
    # innermost first, none of the package's own frames
    assert [f["function"] for f in first] == ["users_function", "<module>"]
    assert [f["function"] for f in second] == ["<module>"]
    assert all(f["file"] == str(script) for f in first + second)
    assert np.all(np.diff([e["time_issued"] for e in entries]) >= 0)
