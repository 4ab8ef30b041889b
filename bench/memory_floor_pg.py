"""A torch process group that sends nothing, but does the local memory work of FSDP2's two
collectives: bench_train's ``floor_mem``, a floor for FSDP2 steps below which no
implementation of those collectives can go on this machine.

torch's ``fake`` group (bench_train's ``floor``) returns at once without touching the
tensors, so FSDP2's all_gather outputs are never written: its copy-out then reads
untouched pages, which the kernel maps to the zero page. A real all_gather must write
every byte of a fresh output (FSDP2 allocates one a call), faulting in and zeroing its
pages, and a real reduce_scatter must read every rank's block and write its own. This
group does exactly that much, all of it from this rank's own memory:

- ``all_gather_single(out, inp)``: ``inp`` copied into each of ``out``'s blocks (its own
  block skipped where ``inp`` is that block, FSDP2's in-place form): the bytes a rank's
  all_gather output receives, from a source in this rank's cache;
- ``reduce_scatter_single(out, inp)``: ``out`` = the sum of ``inp``'s blocks: the reads
  and additions of a reduce_scatter, without a peer's memory.

No rank waits for another, and no byte crosses between processes. An all_gather or a
reduce_scatter needs every rank's input, so a real one also waits once a call: with
``sync`` (a torch group) each call ends with a 4-byte all_reduce over it. The memory work
plus that wait is a lower bound for any implementation of the two calls, ours included;
``work=False`` leaves the waits alone, to tell the two costs apart. bench_train's FSDP2
cases name the three ``floor_mem``, ``floor_mem_sync`` and ``floor_sync``. The values
this group produces are wrong; the benchmark reads only times.

For DDP, :func:`ddp_hook` is the same idea as a comm hook (bench_train's DDP
``floor_mem`` and ``floor_mem_sync``).
"""
import torch
import torch.distributed as td

from collectives.torch_bridge.torch_work import TorchWork

NAME = "memfloor"


class MemoryFloorGroup(td.ProcessGroup):
    """See the module's docstring."""

    #: a torch group whose 4-byte all_reduce follows every call (``floor_mem_sync``: the
    #: memory work plus the one wait a call of a real collective has), or None
    sync = None
    #: whether the calls do the memory work (False, with ``sync``: the ``fake`` floor plus
    #: the waits alone, FSDP2's ``floor_sync``)
    work = True

    def _done(self, result):
        """The call's Work, finished: the bridge's with no call pending (``wait`` returns
        at once, the future holds the outputs), after the wait with ``sync``."""
        if self.sync is not None:
            td.all_reduce(torch.zeros(1), group=self.sync)
        return TorchWork(None, result)

    # torch's C++ ProcessGroup keeps its name in its backends, and this group has none:
    # the name torch gives it is kept here, for torch's Python code (DeviceMesh reads it)
    def _set_group_name(self, name):
        self._name = name

    @property
    def group_name(self):
        return self._name

    def getBackendName(self):  # noqa: N802  (torch's name)
        return NAME

    def all_gather_single(self, output, input, opts=None):  # noqa: A002
        flat = input.reshape(-1)
        for block in output.reshape(self.size(), -1) if self.work else ():
            if block.data_ptr() != flat.data_ptr():
                block.copy_(flat)
        return self._done([output])

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002
        if self.work:
            torch.sum(input.reshape(self.size(), -1), dim=0, out=output.reshape(-1))
        return self._done([output])

    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts=None):
        return TorchWork(None, [])


class DdpHookState:
    """State of :func:`ddp_hook`: ``sync`` as in MemoryFloorGroup (None: no wait)."""

    def __init__(self, sync=None):
        self.sync = sync


def ddp_hook(state, bucket):
    """DDP's memory floor, a comm hook: the least memory work of an all_reduce of the
    bucket (every rank reads its G bytes once and writes the sum once: 2G a rank), done
    in place on the rank's own bucket, then with ``state.sync`` a 4-byte all_reduce over
    it: the one wait a bucket's all_reduce has. The bucket keeps its values (times one)."""
    buf = bucket.buffer()
    torch.mul(buf, 1.0, out=buf)
    if state.sync is not None:
        td.all_reduce(torch.zeros(1), group=state.sync)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _create(opts, _options=None):
    pg = MemoryFloorGroup(opts.group_rank, opts.group_size)
    pg._set_group_name(opts.group_id)
    return pg


def new_group(sync=None, work=True):
    """A memory-floor group over every rank (registers the backend name on first use);
    ``sync``, ``work``: see ``MemoryFloorGroup``'s attributes."""
    if NAME.upper() not in td.Backend._plugins:
        td.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
    pg = td.new_group(backend=NAME)
    pg.sync, pg.work = sync, work
    return pg
