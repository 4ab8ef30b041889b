"""Every collective, on every backend configuration, against a NumPy reference.

Property: for any world size 1-6, group membership, dtype, shape (0-d, empty, one
element, odd lengths), op, root and sync/async interleaving, each rank ends with
what the NumPy reference computes from all ranks' deterministic inputs (exactly
for integers and bools, within rounding for floats), and all_reduce results are
bitwise identical on every rank.
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.collective_cases import DTYPES, FACTORS, OPS_FOR, check, family, run_case
from tests.ranks import available_configs, backend_pool

CONFIGS = available_configs()


@pytest.fixture(scope="module", params=CONFIGS)
def config(request):
    """A backend configuration; module scope so that tests sharing one run back to back
    (its rank pools stay warm)."""
    return request.param
REDUCING = ["all_reduce", "reduce", "reduce_scatter", "reduce_scatter_single", "all_reduce_coalesced"]
MOVING = ["broadcast", "all_gather", "all_gather_single", "gather", "scatter", "all_to_all",
          "all_to_all_single", "barrier"]
SHAPES = [(), (0,), (1,), (5,), (3, 2), (7,), (2, 0, 3)]
SETTINGS = settings(max_examples=12, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def steps(draw, kinds, n):
    kind = draw(st.sampled_from(kinds))
    dtype = draw(st.sampled_from(DTYPES))
    step = {
        "kind": kind, "dtype": dtype,
        "lib": "torch" if dtype == "bfloat16" else draw(st.sampled_from(["torch", "numpy"])),
        "shape": draw(st.sampled_from(SHAPES)),
        "root": draw(st.integers(0, n - 1)),
        "async": draw(st.booleans()),
    }
    if kind in REDUCING:
        op = draw(st.sampled_from(OPS_FOR[family(dtype)]))
        if op == "PREMUL_SUM" and kind == "all_reduce_coalesced":
            op = "SUM"
        step["op"] = op
        if op == "PREMUL_SUM":
            step["factor"] = draw(st.sampled_from(FACTORS))
    return step


@st.composite
def cases(draw, kinds):
    world = draw(st.integers(1, 6))
    if world > 1 and draw(st.booleans()):
        members = sorted(draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world)))
    else:
        members = list(range(world))
    n = len(members)
    return world, {
        "members": members,
        "world": draw(st.booleans()) if n == world else False,
        "seed": draw(st.integers(0, 2**31)),
        "steps": draw(st.lists(steps(kinds, n), min_size=1, max_size=3)),
        "wait_reversed": draw(st.booleans()),
    }


def _run(config, world, case):
    pool = backend_pool(config, world)
    results = pool.run(run_case, case, timeout=90)
    check(case, results, world)


@pytest.mark.timeout(600)
@SETTINGS
@given(wc=cases(REDUCING))
def test_reductions_match_numpy_and_agree_bitwise(config, wc):
    _run(config, *wc)


@pytest.mark.timeout(600)
@SETTINGS
@given(wc=cases(MOVING))
def test_data_movement_matches_numpy(config, wc):
    _run(config, *wc)


@pytest.mark.timeout(600)
@SETTINGS
@given(wc=cases(REDUCING + MOVING))
def test_interleaved_sync_and_async_collectives(config, wc):
    _run(config, *wc)


# ---- examples (the properties above, pinned) ------------------------------------------------

@pytest.mark.timeout(300)
def test_every_dtype_all_reduce_sum_on_four_ranks(config):
    for dtype in DTYPES:
        case = {"members": [0, 1, 2, 3], "seed": 5, "wait_reversed": False,
                "steps": [{"kind": "all_reduce", "dtype": dtype, "lib": "torch", "shape": (7,),
                           "root": 0, "async": False, "op": "SUM"}]}
        _run(config, 4, case)


@pytest.mark.timeout(300)
def test_uneven_all_to_all_single_in_a_subgroup(config):
    case = {"members": [0, 2, 3], "seed": 11, "wait_reversed": True,
            "steps": [{"kind": "all_to_all_single", "dtype": "int32", "lib": "numpy", "shape": (1,),
                       "root": 0, "async": True},
                      {"kind": "all_to_all", "dtype": "float64", "lib": "torch", "shape": (1,),
                       "root": 0, "async": False}]}
    _run(config, 4, case)
