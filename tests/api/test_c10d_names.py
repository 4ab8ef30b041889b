"""collectives.distributed_c10d and collectives.constants: torch's module names, for
programs that import from them."""
import datetime

import pytest

import collectives
from tests.support.ranks import available_configs, backend_pool


def test_the_package_names_and_the_constants_are_there():
    c10d = collectives.distributed_c10d
    for name in collectives.__all__:
        assert getattr(c10d, name) is getattr(collectives, name), name
    assert collectives.constants.default_pg_timeout == datetime.timedelta(minutes=30)
    assert collectives.constants.default_pg_nccl_timeout == datetime.timedelta(minutes=10)
    assert c10d._get_default_timeout("NCCL") == datetime.timedelta(minutes=10)
    assert c10d._get_default_timeout(collectives.Backend.GLOO) == datetime.timedelta(minutes=30)


def test_every_function_takes_torchs_parameters_in_torchs_order():
    """A program passing torch's keyword (or positional) arguments runs unchanged: each
    public function (and DeviceMesh method) torch and collectives both have takes torch's
    parameters first, in torch's order."""
    import importlib
    import inspect
    import warnings
    pytest.importorskip("torch.distributed")
    pairs = [("torch.distributed", "collectives"),
             ("torch.distributed.distributed_c10d", "collectives.distributed_c10d"),
             ("torch.distributed.nn.functional", "collectives.nn"),
             ("torch.distributed.device_mesh", "collectives.device_mesh")]
    differ = []
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecated names warn when read
        for theirs_name, ours_name in pairs:
            theirs_mod = importlib.import_module(theirs_name)
            ours_mod = importlib.import_module(ours_name)
            spaces = [(theirs_mod, ours_mod)]
            if hasattr(theirs_mod, "DeviceMesh"):
                spaces.append((theirs_mod.DeviceMesh, ours_mod.DeviceMesh))
            for theirs_ns, ours_ns in spaces:
                for name in dir(theirs_ns):
                    theirs = getattr(theirs_ns, name)
                    if name.startswith("__") or not inspect.isfunction(theirs) \
                            or not hasattr(ours_ns, name):
                        continue
                    want = list(inspect.signature(theirs).parameters)
                    got = list(inspect.signature(getattr(ours_ns, name)).parameters)
                    checked += 1
                    if got[:len(want)] != want:
                        differ.append(f"{ours_name}.{name}: torch {want}, ours {got}")
    assert checked > 120, checked  # (157 on torch 2.13)
    assert not differ, "\n".join(differ)


def names_case(ctx):
    """Run on every rank of 3: the helpers, on the world and on a subgroup of ranks 2 and 0."""
    import warnings

    import collectives as dist
    from collectives import distributed_c10d as c10d
    sub = dist.new_group([2, 0])
    out = {"default_is_world": c10d._get_default_group() is dist.group.WORLD,
           "not_in_sub": c10d._rank_not_in_group(sub),
           "not_in_world": c10d._rank_not_in_group(None),
           "device": str(c10d._get_pg_default_device()),
           "store": c10d._get_default_store() is not None,
           "world_ranks": c10d._pg_group_ranks[dist.group.WORLD]}
    if not out["not_in_sub"]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["global_of_1"] = c10d._get_global_rank(sub, 1)
        out["warned"] = [str(w.category.__name__) for w in caught]
        out["size"] = c10d._get_group_size(sub)
        out["sub_ranks"] = c10d._pg_group_ranks[sub]
        name = c10d._get_process_group_name(sub)
        out["resolved"] = c10d._resolve_process_group(name) is sub
        out["names"] = c10d._pg_names[sub] == name
        dist.destroy_process_group(sub)
    try:
        c10d._resolve_process_group("no-such-group")
        out["unknown"] = None
    except ValueError as e:
        out["unknown"] = str(e)
    return out


@pytest.mark.timeout(300)
def test_private_helpers_answer_as_torch_on_a_subgroup():
    if "gloo" not in available_configs():
        pytest.skip("the gloo configuration is not available")
    results = backend_pool("gloo", 3).run(names_case, timeout=60)
    for r, got in enumerate(results):
        assert got["default_is_world"] and not got["not_in_world"]
        assert got["not_in_sub"] == (r == 1)
        assert got["device"] == "cpu" and got["store"]
        assert got["world_ranks"] == {0: 0, 1: 1, 2: 2}
        assert "no-such-group" in got["unknown"]
        if r != 1:
            assert got["global_of_1"] == 2  # new_group sorts: group rank 1 is global 2
            assert got["warned"] == ["FutureWarning"]
            assert got["size"] == 2
            assert got["sub_ranks"] == {0: 0, 2: 1}
            assert got["resolved"] and got["names"]
