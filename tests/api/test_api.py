"""The front end in one process: names, init/destroy, groups, misuse, Work, overhead.

A recording backend stands in for the transport: it reports every call, so a
misuse test can check that nothing was sent before the error, and it behaves as
a world of one rank (its size may be larger: nothing ever waits on a peer).
"""
import concurrent.futures
import importlib.util
import time
from datetime import timedelta

import numpy as np
import pytest
import collectives as dist
from collectives import backends
from collectives.backends import Backend, DoneRequest
from collectives.core.errors import DistBackendError
from collectives.store import HashStore

try:
    import torch
except ImportError:  # a NumPy-only install: the tests that need torch skip
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch (pip install 'collectives[torch]')")

NOT_INIT = "Default process group has not been initialized, please make sure to call init_process_group."


class Recorder(Backend):
    """Records calls; collectives act as on a world of one rank."""

    name = "recorder"
    instances = []

    def __init__(self, store, rank, size, timeout, options=None):
        super().__init__(store, rank, size, timeout, options)
        self.calls = []
        self.fail = None
        Recorder.instances.append(self)

    def _call(self, name, *args):
        self.calls.append((name,) + args)
        if self.fail is not None:
            raise self.fail

    def broadcast(self, buf, root):
        self._call("broadcast", root)

    def all_reduce(self, buf, op):
        self._call("all_reduce", op)

    def reduce(self, buf, op, root):
        self._call("reduce", op, root)

    def all_gather(self, out, inp):
        self._call("all_gather")
        out.numpy()[:inp.count] = inp.numpy()

    def gather(self, out, inp, root):
        self._call("gather", root)

    def scatter(self, out, inp, root):
        self._call("scatter", root)

    def reduce_scatter(self, out, inp, op):
        self._call("reduce_scatter", op)

    def all_to_all(self, out, inp, out_counts, in_counts):
        self._call("all_to_all", out_counts, in_counts)

    def barrier(self):
        self._call("barrier")

    def isend(self, buf, dst, tag=0):
        self._call("isend", dst, tag)
        return DoneRequest()

    def irecv(self, buf, src, tag=0):
        self._call("irecv", src, tag)
        return DoneRequest(source=self.size - 1 if src is None else src)


class Noop(Backend):
    name = "noop"

    def all_reduce(self, buf, op):
        pass


for _name, _factory in (("recorder", Recorder), ("noop", Noop)):
    if _name not in backends.registered_backends():
        backends.register_backend(_name, _factory)


@pytest.fixture
def world():
    """A world of 4 ranks seen from rank 0 (the recorder never waits on the others)."""
    def start(size=4, rank=0, backend="recorder"):
        Recorder.instances.clear()
        dist.init_process_group(backend, store=HashStore(), rank=rank, world_size=size, timeout=5)
        return Recorder.instances[0] if Recorder.instances else None
    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def no_calls():
    return all(not r.calls for r in Recorder.instances)


# ---- names ---------------------------------------------------------------------------------

@needs_torch
def test_reduce_op_members_are_int_codes_as_in_torch():
    import torch.distributed as tdist
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        ours = getattr(dist.ReduceOp, name)
        assert int(ours) == int(getattr(tdist.ReduceOp, name)) == getattr(dist.dtypes, name)
        assert getattr(dist.ReduceOp.RedOpType, name) == ours
    premul = dist.ReduceOp.PREMUL_SUM(0.25)
    assert int(premul) == 8 == dist.ReduceOp.PREMUL_SUM and premul.factor == 0.25


@needs_torch
def test_torch_reduce_ops_are_taken_as_ours():
    """A program that spells its ops torch.distributed.ReduceOp.X gets the same reduction."""
    import torch.distributed as tdist

    from collectives.core.reduce_op import op_code
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        theirs = getattr(tdist.ReduceOp, name)
        assert op_code(theirs) == op_code(tdist.ReduceOp(theirs)) == getattr(dist.ReduceOp, name)
    with pytest.raises(ValueError, match="op"):
        op_code("SUM")


def test_deprecated_reduce_op_alias_warns_and_works():
    with pytest.warns(FutureWarning, match="deprecated"):
        assert dist.reduce_op.MAX == dist.ReduceOp.MAX


def test_backend_names_and_availability():
    assert dist.Backend.GLOO == "gloo" and dist.Backend.MPI == "mpi" and dist.Backend.NCCL == "nccl"
    assert dist.Backend("GLOO") == "gloo"
    assert dist.is_available() is True
    assert dist.is_mpi_available() == (importlib.util.find_spec("mpi4py") is not None)
    assert dist.is_nccl_available() is False  # no GPU here
    assert dist.is_backend_available("recorder")
    assert not dist.is_backend_available("no-such-backend")
    assert not dist.is_initialized()
    assert dist.group.WORLD is None and dist.GroupMember.WORLD is None


@needs_torch
def test_small_helpers_answer_as_torch_does(monkeypatch):
    import torch.distributed as tdist
    assert dist.default_pg_timeout == tdist.default_pg_timeout == timedelta(minutes=30)
    for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        assert dist.supports_complex(getattr(dist.ReduceOp, op)) == \
            tdist.supports_complex(getattr(tdist.ReduceOp, op)), op
    assert dist.supports_complex(dist.ReduceOp.PREMUL_SUM(2.0))
    with pytest.raises(ValueError, match="reduceOp must be a ReduceOp"):
        dist.supports_complex("max")
    for dev in ("cpu", "cuda", "cuda:1", torch.device("cpu"), torch.device("cuda", 0)):
        assert dist.get_default_backend_for_device(dev) == {"cpu": "gloo", "cuda": "nccl"}[
            torch.device(dev).type]
    with pytest.raises(ValueError, match="Default backend not registered for device : meta"):
        dist.get_default_backend_for_device("meta")
    with pytest.raises(TypeError, match="device must be"):
        dist.get_default_backend_for_device(0)
    assert dist.is_ucc_available() is False and dist.is_xccl_available() is False
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(RuntimeError, match="LOCAL_RANK is not in the environment"):
        dist.get_node_local_rank()
    assert dist.get_node_local_rank(fallback_rank=3) == 3
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert dist.get_node_local_rank(fallback_rank=3) == 5


def test_process_group_count_and_backend_config(world):
    assert dist.get_pg_count() == 0
    with pytest.raises(ValueError, match="has not been initialized"):
        dist.get_backend_config()
    world(size=2, rank=0)
    assert dist.get_pg_count() == 1 and dist.get_backend_config() == "cpu:recorder"
    g = dist.new_group([0])
    assert dist.get_pg_count() == 2 and dist.get_backend_config(g) == "cpu:recorder"
    assert dist.new_group([1]) is dist.GroupMember.NON_GROUP_MEMBER
    assert dist.get_pg_count() == 3  # every rank counts every new_group, as in torch
    with pytest.raises(ValueError, match="Invalid process group"):
        dist.get_backend_config(dist.GroupMember.NON_GROUP_MEMBER)
    dist.new_group([0], use_local_synchronization=True)
    dist.destroy_process_group(g)
    assert dist.get_pg_count() == 3
    dist.destroy_process_group()
    assert dist.get_pg_count() == 0


def test_a_third_party_backend_registers_once():
    import tests.support.store_backend  # noqa: F401  registers "store"
    assert "store" in backends.registered_backends()
    with pytest.raises(ValueError, match="already registered"):
        dist.Backend.register_backend("store", tests.support.store_backend.StoreBackend)


# ---- not initialised, initialised twice, bad init ------------------------------------------

@needs_torch
@pytest.mark.parametrize("call", [
    lambda: dist.all_reduce(torch.ones(1)), lambda: dist.broadcast(torch.ones(1), 0),
    lambda: dist.reduce(torch.ones(1), 0), lambda: dist.all_gather([torch.ones(1)], torch.ones(1)),
    lambda: dist.gather(torch.ones(1)), lambda: dist.scatter(torch.ones(1)),
    lambda: dist.reduce_scatter(torch.ones(1), [torch.ones(1)]),
    lambda: dist.all_to_all([torch.ones(1)], [torch.ones(1)]), lambda: dist.barrier(),
    lambda: dist.send(torch.ones(1), 1), lambda: dist.recv(torch.ones(1), 1),
    lambda: dist.isend(torch.ones(1), 1), lambda: dist.irecv(torch.ones(1)),
    lambda: dist.get_rank(), lambda: dist.get_world_size(), lambda: dist.get_backend(),
    lambda: dist.new_group([0]), lambda: dist.all_gather_object([None], 1),
    lambda: dist.broadcast_object_list([1]), lambda: dist.monitored_barrier(),
    lambda: dist.all_to_all_single(torch.ones(1), torch.ones(1)),
])
def test_every_call_before_init_raises_torchs_message(call):
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value) == NOT_INIT


def test_init_twice_unknown_backend_and_bad_arguments(world):
    with pytest.raises(ValueError, match="Invalid backend: 'nope'"):
        dist.init_process_group("nope", store=HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="Cannot specify both init_method and store"):
        dist.init_process_group("recorder", init_method="env://", store=HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="rank must be in"):
        dist.init_process_group("recorder", store=HashStore(), rank=3, world_size=2)
    assert not dist.is_initialized()
    world(size=1)
    with pytest.raises(ValueError, match="twice"):
        dist.init_process_group("recorder", store=HashStore(), rank=0, world_size=1)


def test_torchs_private_ranks_argument_names_the_world_group_as_torch(world):
    import hashlib
    dist.init_process_group("recorder", store=HashStore(), rank=0, world_size=1, _ranks=[0])
    assert dist.group.WORLD.group_name == hashlib.sha1(b"0_0").hexdigest()


def test_torch_style_device_backend_string_picks_the_cpu_entry(world):
    dist.init_process_group("cuda:nccl,cpu:recorder", store=HashStore(), rank=0, world_size=1)
    assert dist.get_backend() == "recorder"


def test_world_state_and_destroy(world):
    world(size=3, rank=2)
    assert dist.is_initialized()
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (2, 3, "recorder")
    assert dist.group.WORLD is dist.GroupMember.WORLD is not None
    assert dist.get_process_group_ranks(dist.group.WORLD) == [0, 1, 2]
    dist.destroy_process_group()
    assert not dist.is_initialized() and dist.group.WORLD is None


# ---- groups -------------------------------------------------------------------------------------

@needs_torch
def test_new_group_ranks_and_non_members(world):
    world(size=4, rank=1)
    g = dist.new_group([3, 1])
    assert dist.get_process_group_ranks(g) == [1, 3]
    assert (dist.get_rank(g), dist.get_world_size(g)) == (0, 2)
    assert dist.get_global_rank(g, 1) == 3 and dist.get_group_rank(g, 3) == 1
    with pytest.raises(ValueError, match="not a rank of group"):
        dist.get_group_rank(g, 2)
    other = dist.new_group([0, 2])
    assert other == dist.GroupMember.NON_GROUP_MEMBER
    assert dist.get_rank(other) == -1 and dist.get_world_size(other) == -1
    assert dist.all_reduce(torch.ones(1), group=other) is None
    sub = Recorder.instances[-1]
    dist.all_reduce(torch.ones(2), group=g)
    assert sub.calls == [("all_reduce", dist.dtypes.SUM)] and sub.size == 2 and sub.rank == 0
    with pytest.raises(ValueError, match=r"ranks must hold global ranks in \[0, 4\)"):
        dist.new_group([0, 4])
    with pytest.raises(ValueError, match="repeat"):
        dist.new_group([1, 1])


def test_new_subgroups_splits_the_world(world):
    world(size=4, rank=2)
    mine, groups = dist.new_subgroups(2)
    assert len(groups) == 2 and dist.get_process_group_ranks(mine) == [2, 3]
    assert groups[0] == dist.GroupMember.NON_GROUP_MEMBER
    with pytest.raises(ValueError, match="group_size must divide"):
        dist.new_subgroups(3)


# ---- misuse raises before anything is sent -------------------------------------------------------

MISUSE = [
    ("AVG on an integer tensor", ValueError, "needs a floating or complex",
     lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG)),
    ("MAX on complex", ValueError, "not defined for complex64",
     lambda: dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=dist.ReduceOp.MAX)),
    ("BAND on float", ValueError, "not defined for float32",
     lambda: dist.all_reduce(np.ones(2, np.float32), op=dist.ReduceOp.BAND)),
    ("PREMUL_SUM without a factor", ValueError, "needs a factor",
     lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.PREMUL_SUM)),
    ("AVG on int in reduce_scatter", ValueError, "needs a floating",
     lambda: dist.reduce_scatter(torch.ones(1, dtype=torch.int64),
                                 [torch.ones(1, dtype=torch.int64)] * 4, op=dist.ReduceOp.AVG)),
    ("non-contiguous tensor", ValueError, "contiguous",
     lambda: dist.all_reduce(torch.ones(4, 4).t())),
    ("non-contiguous array", ValueError, "contiguous",
     lambda: dist.broadcast(np.ones((4, 4))[:, 1], 0)),
    ("lazy conjugate view", ValueError, "lazy conjugate",
     lambda: dist.all_reduce(torch.ones(2, dtype=torch.complex64).conj())),
    ("lazy negative view", ValueError, "lazy conjugate or negative",
     lambda: dist.all_reduce(torch._neg_view(torch.ones(2)))),
    ("not a tensor", TypeError, "torch.Tensor or numpy.ndarray",
     lambda: dist.all_reduce([1.0, 2.0])),
    ("unsupported dtype", TypeError, "unsupported dtype",
     lambda: dist.all_reduce(np.ones(2, np.uint32))),
    ("wrong list length", ValueError, "must hold 4 tensors",
     lambda: dist.all_gather([torch.ones(1)] * 3, torch.ones(1))),
    ("mismatched dtype in a list", ValueError, "dtype float64",
     lambda: dist.all_gather([torch.ones(1)] * 3 + [torch.ones(1, dtype=torch.float64)], torch.ones(1))),
    ("mismatched size in a list", ValueError, "has 2 elements; expected 1",
     lambda: dist.all_gather([torch.ones(1)] * 3 + [torch.ones(2)], torch.ones(1))),
    ("all_gather_into_tensor size", ValueError, "expected 8",
     lambda: dist.all_gather_into_tensor(torch.ones(7), torch.ones(2))),
    ("gather_list on a non-destination rank", ValueError, "must NOT be specified",
     lambda: dist.gather(torch.ones(1), [torch.ones(1)] * 4, dst=1)),
    ("scatter_list on a non-source rank", ValueError, "must NOT be specified",
     lambda: dist.scatter(torch.ones(1), [torch.ones(1)] * 4, src=2)),
    ("gather_list missing on the destination", ValueError, "gather_list must be given",
     lambda: dist.gather(torch.ones(1), None, dst=0)),
    ("send to self", ValueError, "should not be the same",
     lambda: dist.send(torch.ones(1), 0)),
    ("recv from self", ValueError, "should not be the same",
     lambda: dist.recv(torch.ones(1), 0)),
    ("send rank out of range", ValueError, "dst=4 is not a rank",
     lambda: dist.send(torch.ones(1), 4)),
    ("isend rank out of range", ValueError, "dst=-1 is not a rank",
     lambda: dist.isend(torch.ones(1), -1)),
    ("broadcast src out of range", ValueError, "src=7",
     lambda: dist.broadcast(torch.ones(1), 7)),
    ("reduce dst out of range", ValueError, "dst=9",
     lambda: dist.reduce(torch.ones(1), 9)),
    ("negative tag", ValueError, "tag must be",
     lambda: dist.send(torch.ones(1), 1, tag=-3)),
    ("tag of 2**31", ValueError, r"tag must be an int in \[0, 2\*\*31\)",
     lambda: dist.irecv(torch.ones(1), 1, tag=2**31)),
    ("uneven split that does not sum", ValueError, "sums to 3",
     lambda: dist.all_to_all_single(torch.ones(4), torch.ones(4), [1, 1, 1, 1], [1, 1, 1, 0])),
    ("even split that does not divide", ValueError, "divide evenly",
     lambda: dist.all_to_all_single(torch.ones(5), torch.ones(5))),
    ("all_to_all dtype mismatch", ValueError, "dtype int32",
     lambda: dist.all_to_all([torch.ones(1)] * 3 + [torch.ones(1, dtype=torch.int32)], [torch.ones(1)] * 4)),
    ("P2POp with a collective", ValueError, "Invalid ``op``",
     lambda: dist.P2POp(dist.all_reduce, torch.ones(1), 1)),
    ("batch with a bad peer", ValueError, "dst=5",
     lambda: dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.ones(1), 1),
                                     dist.P2POp(dist.isend, torch.ones(1), 5)])),
    ("object list of the wrong length", ValueError, "must hold 4 entries",
     lambda: dist.all_gather_object([None] * 2, {"a": 1})),
    ("group of the wrong type", TypeError, "group must be a ProcessGroup",
     lambda: dist.all_reduce(torch.ones(1), group="world")),
    ("all_gather_coalesced with too few lists", ValueError, "must hold 4 lists",
     lambda: dist.all_gather_coalesced([[torch.ones(1)]] * 3, [torch.ones(1)])),
    ("all_gather_coalesced output of the wrong size", ValueError,
     r"output_tensor_lists\[2\]\[1\] has 3 elements; expected 2",
     lambda: dist.all_gather_coalesced([[torch.ones(1), torch.ones(2)]] * 2
                                       + [[torch.ones(1), torch.ones(3)]] * 2,
                                       [torch.ones(1), torch.ones(2)])),
    ("all_gather_coalesced mixed dtypes", ValueError, "dtype int32",
     lambda: dist.all_gather_coalesced([[torch.ones(1)] * 2] * 4,
                                       [torch.ones(1), torch.ones(1, dtype=torch.int32)])),
    ("all_gather_coalesced no inputs", ValueError, "at least one tensor",
     lambda: dist.all_gather_coalesced([[]] * 4, [])),
    ("split_group without split_ranks", ValueError, "split_ranks must be a non-empty list",
     lambda: dist.split_group()),
    ("split_group rank outside the parent", ValueError, r"in \[0, 4\), got 4",
     lambda: dist.split_group(split_ranks=[[0, 1], [2, 4]])),
    ("split_group rank twice", ValueError, "got 1 twice",
     lambda: dist.split_group(split_ranks=[[0, 1], [1, 2]])),
    ("split_group empty part", ValueError, "non-empty lists",
     lambda: dist.split_group(split_ranks=[[0, 1], []])),
    ("shrink_group with a tuple", TypeError, "ranks_to_exclude must be a list",
     lambda: dist.shrink_group((1,))),
    ("shrink_group excluding nobody", ValueError, "at least one rank",
     lambda: dist.shrink_group([])),
    ("shrink_group with unknown flags", ValueError, "shrink_flags must be SHRINK_DEFAULT",
     lambda: dist.shrink_group([1], shrink_flags=2)),
    ("shrink_group rank out of the group", ValueError, r"in \[0, 4\), got 4 at index 1",
     lambda: dist.shrink_group([1, 4])),
    ("shrink_group rank not an int", TypeError, "must hold ints, got '1'",
     lambda: dist.shrink_group(["1"])),
    ("shrink_group rank twice", ValueError, "got 2 again at index 2",
     lambda: dist.shrink_group([2, 1, 2])),
    ("shrink_group excluding every rank", ValueError, "leave at least one of the group's 4",
     lambda: dist.shrink_group([3, 2, 1, 0])),
    ("shrink_group excluding this rank", ValueError, r"this rank \(0 of the group\) is in",
     lambda: dist.shrink_group([0, 2])),
]


@pytest.mark.parametrize("what,exc,msg,call", [
    pytest.param(*m, id=m[0], marks=[needs_torch] if "torch" in m[3].__code__.co_names else [])
    for m in MISUSE])
def test_misuse_raises_before_any_communication(world, what, exc, msg, call):
    world(size=4, rank=0)
    with pytest.raises(exc, match=msg):
        call()
    assert no_calls(), f"{what}: the backend was called: {[r.calls for r in Recorder.instances]}"


def test_shrink_group_on_a_group_of_one_or_not_of_this_rank(world):
    world(size=4, rank=2)
    one = dist.new_group([2])
    with pytest.raises(ValueError, match="at least 2 ranks to shrink, it has 1"):
        dist.shrink_group([0], group=one)
    other = dist.new_group([0, 1])
    with pytest.raises(ValueError, match="not a member of group"):
        dist.shrink_group([0], group=other)
    assert dist.distributed_c10d.SHRINK_DEFAULT == 0 and dist.distributed_c10d.SHRINK_ABORT == 1


@needs_torch
def test_recv_any_source_returns_the_senders_global_rank(world):
    world(size=4, rank=2)
    g = dist.new_group([1, 2, 3])
    assert dist.recv(torch.zeros(1), group=g) == 3  # the recorder says the last group rank sent it
    w = dist.irecv(torch.zeros(1), group=g)
    w.wait()
    assert w.source_rank() == 3


# ---- Work and futures -----------------------------------------------------------------------------

@needs_torch
def test_work_reports_completion_result_and_future(world):
    world(size=1)
    t = torch.ones(3)
    w = dist.all_reduce(t, async_op=True)
    assert w.wait(timedelta(seconds=5)) is True and w.wait(5) is True
    assert w.is_completed() and w.is_success() and w.exception() is None
    assert w.result()[0] is t
    fut = w.get_future()
    assert fut.result()[0] is t and fut.wait()[0] is t and fut.value()[0] is t
    assert fut.then(lambda f: f.value()[0].sum().item()).wait() == 3.0
    done, _ = concurrent.futures.wait([fut], timeout=5)
    assert done == {fut}


@needs_torch
def test_a_failed_async_op_surfaces_on_wait_and_future(world):
    rec = world(size=1)
    rec.fail = DistBackendError("peer 1 went away")
    w = dist.all_reduce(torch.ones(1), async_op=True)
    with pytest.raises(DistBackendError, match="went away"):
        w.wait()
    assert w.is_completed() and not w.is_success()
    assert isinstance(w.exception(), DistBackendError)
    assert isinstance(w.get_future().exception(), DistBackendError)
    with pytest.raises(DistBackendError):
        dist.barrier()


@needs_torch
def test_avg_and_premul_sum_scale_on_a_world_of_one(world):
    world(size=1)
    t = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert t.tolist() == [1.0, 3.0]
    a = np.array([1.0, -2.0], np.float16)
    dist.all_reduce(a, op=dist.ReduceOp.PREMUL_SUM(0.5))
    assert a.tolist() == [0.5, -1.0]
    c = torch.tensor([1 + 2j], dtype=torch.complex64)
    dist.all_reduce(c, op=dist.ReduceOp.PREMUL_SUM(torch.tensor(2.0)))
    assert c.tolist() == [2 + 4j]
    keep = torch.tensor([4.0, 8.0])
    dist.reduce(keep, 0, op=dist.ReduceOp.PREMUL_SUM(0.25))
    assert keep.tolist() == [1.0, 2.0]


@needs_torch
def test_avg_scales_by_the_group_size(world):
    world(size=4, rank=0)  # the recorder leaves the sum as the input: AVG divides it by 4
    t = torch.tensor([4.0, 8.0])
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert t.tolist() == [1.0, 2.0]
    rs_in = [torch.full((2,), 8.0) for _ in range(4)]
    out = torch.zeros(2)
    dist.reduce_scatter(out, rs_in, op=dist.ReduceOp.PREMUL_SUM(0.5))
    assert [x.tolist() for x in rs_in] == [[8.0, 8.0]] * 4  # inputs unchanged


@needs_torch
def test_multigpu_one_element_list_is_the_plain_call(world):
    world(size=1)
    t = [torch.tensor([2.0]), torch.tensor([5.0])]
    dist.all_reduce_multigpu(t)
    assert [x.item() for x in t] == [7.0, 7.0]
    one = [np.array([3.0])]
    dist.all_reduce_multigpu(one, op=dist.ReduceOp.MAX)
    assert one[0].tolist() == [3.0]
    outs = [[torch.zeros(1), torch.zeros(1)], [torch.zeros(1), torch.zeros(1)]]
    dist.all_gather_multigpu(outs, [torch.tensor([1.0]), torch.tensor([2.0])])
    assert [[x.item() for x in o] for o in outs] == [[1.0, 2.0], [1.0, 2.0]]


# ---- per-call overhead ---------------------------------------------------------------------------

@needs_torch
@pytest.mark.parametrize("in_place_ok", [True, False])
def test_own_block_in_place_reaches_the_backend_only_where_it_says_it_takes_it(
        world, monkeypatch, in_place_ok):
    """all_gather_into_tensor(out, out.chunk(n)[rank]) and reduce_scatter_tensor(
    inp.chunk(n)[rank], inp) hand the backend the aliased buffers when it sets
    own_block_in_place, a copy of the input otherwise (and always for other overlaps)."""
    monkeypatch.setattr(Recorder, "own_block_in_place", in_place_ok)
    rec = world(size=4, rank=2)
    seen = []
    rec.all_gather = lambda out, inp: seen.append(("all_gather", out.ptr, inp.ptr))
    rec.reduce_scatter = lambda out, inp, op: seen.append(("reduce_scatter", inp.ptr, out.ptr))
    big = torch.arange(12.0)
    block = big[6:9]  # rank 2's block
    dist.all_gather_into_tensor(big, block)
    dist.reduce_scatter_tensor(block, big)
    dist.all_gather_into_tensor(big, big[5:8])  # overlapping, not the own block: copied
    assert [(op, whole == big.data_ptr(), part == block.data_ptr()) for op, whole, part in seen] == [
        ("all_gather", True, in_place_ok), ("reduce_scatter", in_place_ok, True),
        ("all_gather", True, False)]


@needs_torch
@pytest.mark.parametrize("in_place_ok", [True, False])
def test_own_block_in_place_takes_the_direct_call_where_the_backend_takes_it(
        world, monkeypatch, in_place_ok):
    """The in-place forms (FSDP2 calls all_gather_into_tensor so) go from the front end's
    one check straight to the backend, as the out-of-place forms do, where the group's
    backend takes them; elsewhere, and for any other overlap, through the planned path that
    copies the input."""
    from collectives.api import _generated
    monkeypatch.setattr(Recorder, "own_block_in_place", in_place_ok)
    planned = []
    for name in ("_plan_all_gather_single", "_plan_reduce_scatter_single"):
        real = getattr(_generated, name)
        monkeypatch.setattr(_generated, name,
                            lambda *a, _n=name, _r=real: planned.append(_n) or _r(*a))
    rec = world(size=4, rank=2)
    seen = []
    rec.all_gather = lambda out, inp: seen.append("all_gather")
    rec.reduce_scatter = lambda out, inp, op: seen.append("reduce_scatter")
    big = torch.arange(12.0)
    block = big[6:9]  # rank 2's block
    dist.all_gather_into_tensor(big, block)
    dist.reduce_scatter_tensor(block, big)
    assert planned == ([] if in_place_ok else
                       ["_plan_all_gather_single", "_plan_reduce_scatter_single"])
    dist.all_gather_into_tensor(big, big[5:8])  # overlapping, not the own block
    dist.reduce_scatter_tensor(big[5:8], big)
    assert planned[-2:] == ["_plan_all_gather_single", "_plan_reduce_scatter_single"]
    assert seen == ["all_gather", "reduce_scatter"] * 2


@needs_torch
@pytest.mark.parametrize("into_list", [True, False])
def test_all_gather_into_separate_tensors_reaches_a_list_backend_unstaged(world, into_list):
    """dist.all_gather(list, t): a backend with gathers_into_list gets the list's own Buffers
    when they are separate tensors (also when t is this rank's entry); contiguous views go
    as one span; an entry overlapping t otherwise, or a backend without it, is staged."""
    rec = world(size=3, rank=1)
    rec.gathers_into_list = into_list
    seen = []
    rec.all_gather = lambda out, inp: seen.append(("span", out.ptr, inp.ptr))
    rec.all_gather_list = lambda outs, inp: seen.append(("list", [b.ptr for b in outs], inp.ptr))
    t = torch.ones(4)
    sep = [torch.zeros(4) for _ in range(3)]
    dist.all_gather(sep, t)
    sep[1] = t
    dist.all_gather(sep, t)
    flat = torch.zeros(12)
    dist.all_gather(list(flat.chunk(3)), t)
    big = torch.zeros(8)
    dist.all_gather([torch.zeros(4), big[2:6], torch.zeros(4)], big[:4])  # overlaps otherwise
    assert [s[0] for s in seen] == (["list", "list", "span", "span"] if into_list else ["span"] * 4)
    if into_list:
        assert seen[1][1] == [b.data_ptr() for b in sep] and seen[1][2] == t.data_ptr()
        assert seen[2][1] == flat.data_ptr()


@needs_torch
def test_a_cuda_tensor_on_a_cpu_backend_is_refused_before_communicating(world, monkeypatch):
    # no GPU here: stand in for a CUDA tensor by making the conversion report device 0
    from collectives.core import convert
    from collectives.core.tensors import Buffer

    def as_cuda(t, name="tensor"):
        return Buffer(0xDEAD0000, t.numel(), dist.dtypes.FLOAT32, 0, t)

    monkeypatch.setattr(convert, "to_buffer", as_cuda)
    world(size=2, rank=0)
    fake = torch.ones(2, 2).t()  # non-contiguous: the fast path leaves it to to_buffer
    for call in (lambda: dist.all_reduce(fake), lambda: dist.broadcast(fake, 0),
                 lambda: dist.isend(fake, 1)):
        with pytest.raises(ValueError, match="CUDA tensor"):
            call()
    assert no_calls()


class _SlowDoubler(Backend):
    """all_reduce doubles the buffer after a delay: async work that is still running."""

    name = "slow-doubler"

    def all_reduce(self, buf, op):
        time.sleep(0.2)
        buf.numpy()[:] *= 2


def test_an_input_copied_at_issue_time_sees_earlier_async_results():
    if "slow-doubler" not in backends.registered_backends():
        backends.register_backend("slow-doubler", _SlowDoubler)
    dist.init_process_group("slow-doubler", store=HashStore(), rank=0, world_size=1)
    try:
        a, b = np.ones(4, np.float32), np.ones(4, np.float32)
        w = dist.all_reduce(a, async_op=True)
        dist.all_reduce_coalesced([a, b])  # stages a copy of a: it must follow the async op
        assert w.is_completed()
        assert a.tolist() == [4.0] * 4 and b.tolist() == [2.0] * 4
    finally:
        dist.destroy_process_group()


class _Recorder(Backend):
    """Logs each call; all_reduce takes 0.2 s, so async work is still queued behind it."""

    name = "order-log"
    log = []

    def all_reduce(self, buf, op):
        time.sleep(0.2)
        _Recorder.log.append("all_reduce")

    def broadcast(self, buf, root):
        _Recorder.log.append("broadcast")

    def all_gather(self, out, inp):
        _Recorder.log.append("all_gather")

    def barrier(self):
        _Recorder.log.append("barrier")


class _OwnRun(_Recorder):
    """A backend with a run() of its own: the front end must call it, not skip it."""

    name = "own-run"

    def all_reduce(self, buf, op):
        _Recorder.log.append("all_reduce")

    def run(self, fn, *args):
        _Recorder.log.append("run")
        return fn(*args)


def _hot_calls():
    a, out = np.ones(2, np.float32), np.empty(2, np.float32)
    dist.all_reduce(a)
    dist.broadcast(a, 0)
    dist.all_gather_into_tensor(out, a)
    dist.barrier()


@pytest.mark.parametrize("cls", [_Recorder, _OwnRun])
def test_blocking_calls_skip_run_only_for_the_base_run_and_wait_behind_queued_work(cls):
    if cls.name not in backends.registered_backends():
        backends.register_backend(cls.name, cls)
    dist.init_process_group(cls.name, store=HashStore(), rank=0, world_size=1)
    try:
        _Recorder.log = []
        _hot_calls()
        hot = ["all_reduce", "broadcast", "all_gather", "barrier"]
        if cls is _OwnRun:  # every blocking call went through its run()
            assert _Recorder.log == [x for name in hot for x in ("run", name)]
            return
        assert _Recorder.log == hot
        _Recorder.log = []
        w = dist.all_reduce(np.ones(2, np.float32), async_op=True)  # queued, 0.2 s
        _hot_calls()  # each blocking call must run after the queued one
        w.wait()
        assert _Recorder.log == ["all_reduce"] + hot
    finally:
        dist.destroy_process_group()


class _SlowCounter(Backend):
    """all_reduce takes 0.6 s and counts its runs."""

    name = "slow-counter"
    runs = 0

    def all_reduce(self, buf, op):
        time.sleep(0.6)
        _SlowCounter.runs += 1


def test_a_blocking_call_that_times_out_in_the_queue_never_runs_later():
    if "slow-counter" not in backends.registered_backends():
        backends.register_backend("slow-counter", _SlowCounter)
    dist.init_process_group("slow-counter", store=HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=0.2))
    try:
        _SlowCounter.runs = 0
        a = np.ones(1, np.float32)
        w = dist.all_reduce(a, async_op=True)
        with pytest.raises(DistBackendError, match="did not finish"):
            dist.all_reduce(a)  # queued behind w, gives up after the group timeout
        w.wait(timedelta(seconds=5))
        time.sleep(0.8)
        assert _SlowCounter.runs == 1
    finally:
        dist.destroy_process_group()


@needs_torch
def test_debug_level_functions_match_torchs(monkeypatch, caplog):
    import torch.distributed as tdist
    assert [(m.name, int(m)) for m in dist.DebugLevel] == \
        [(m, int(getattr(tdist.DebugLevel, m))) for m in ("OFF", "INFO", "DETAIL")]
    assert dist.get_debug_level() == dist.DebugLevel.OFF and str(dist.get_debug_level()) == "DebugLevel.OFF"
    try:
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "info")
        dist.set_debug_level_from_env()
        assert dist.get_debug_level() is dist.DebugLevel.INFO
        with caplog.at_level("INFO", logger="collectives"):
            dist.init_process_group("recorder", store=HashStore(), rank=0, world_size=1)
            dist.destroy_process_group()
        assert "group default_pg: rank 0 of 1" in caplog.text
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "verbose")
        with pytest.raises(ValueError, match="must be OFF, INFO, or DETAIL"):
            dist.set_debug_level_from_env()
        with pytest.raises(TypeError, match="level must be a DebugLevel"):
            dist.set_debug_level(2)
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
