"""Python objects through the object collectives, on every backend configuration.

Property: any picklable objects (of different sizes on different ranks) come out
equal to what the reference says each rank must hold.
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.profiles import examples
from tests.support.ranks import available_configs, backend_pool

CONFIGS = available_configs()


SETTINGS = settings(max_examples=examples(8), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
KINDS = ["all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
         "send_recv_object_list"]

objects = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
    | st.binary(max_size=300),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=10)


def as_list(o, k):
    """k objects: the first k of a long enough list, else k copies of ``o``."""
    return list(o[:k]) if isinstance(o, list) and len(o) >= k else [o] * k


def obj_case(ctx, kind, objs, root, k):
    """objs[r] is rank r's object (or list of k objects); returns what this rank ends with."""
    import collectives as dist
    n, r = ctx.world_size, ctx.rank
    if kind == "all_gather_object":
        out = [None] * n
        dist.all_gather_object(out, objs[r])
        return out
    if kind == "gather_object":
        out = [None] * n if r == root else None
        dist.gather_object(objs[r], out, dst=root)
        return out
    if kind == "broadcast_object_list":
        lst = as_list(objs[r], k) if r == root else [None] * k
        dist.broadcast_object_list(lst, src=root)
        return lst
    if kind == "scatter_object_list":
        out = [None]
        dist.scatter_object_list(out, list(objs) if r == root else None, src=root)
        return out[0]
    if kind == "send_recv_object_list":
        # every rank except root sends its list of k objects to root, which receives from any source
        if r == root:
            got = {}
            for _ in range(n - 1):
                lst = [None] * k
                src = dist.recv_object_list(lst)
                got[src] = lst
            return got
        dist.send_object_list(as_list(objs[r], k), dst=root)
        return None
    raise ValueError(kind)


def expected(kind, objs, root, k, n):
    if kind == "all_gather_object":
        return [list(objs)] * n
    if kind == "gather_object":
        return [list(objs) if r == root else None for r in range(n)]
    if kind == "broadcast_object_list":
        return [as_list(objs[root], k)] * n
    if kind == "scatter_object_list":
        return list(objs)
    return [{s: as_list(objs[s], k) for s in range(n) if s != root} if r == root else None for r in range(n)]


@st.composite
def cases(draw):
    n = draw(st.integers(1, 5))
    kind = draw(st.sampled_from(KINDS))
    if kind == "send_recv_object_list" and n == 1:
        n = 2
    k = draw(st.integers(1, 3))
    if kind == "broadcast_object_list":
        objs = [draw(st.lists(objects, min_size=k, max_size=k)) for _ in range(n)]
    else:
        objs = [draw(objects) for _ in range(n)]
    return n, kind, objs, draw(st.integers(0, n - 1)), k


@pytest.mark.timeout(600)
@SETTINGS
@given(c=cases())
def test_objects_arrive_equal(config, c):
    n, kind, objs, root, k = c
    results = backend_pool(config, n).run(obj_case, kind, objs, root, k, timeout=90)
    assert results == expected(kind, objs, root, k, n)


@pytest.mark.timeout(300)
def test_objects_of_very_different_sizes(config):
    objs = [b"x" * 10_000, {"a": 1}, None]
    n = 3
    for kind in KINDS:
        results = backend_pool(config, n).run(obj_case, kind, objs, 1, 2, timeout=90)
        assert results == expected(kind, objs, 1, 2, n), kind
