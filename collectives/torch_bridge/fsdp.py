"""FSDP2's collectives through memory that every rank of one host maps.

FSDP2 (``torch.distributed.fsdp.fully_shard``) allocates each call's buffer, copies into
it, runs the collective and drops the buffer. On one host the ranks can map those buffers
instead, and each call does less:

- **all_gather** (:class:`SharedAllGather`): the output lives in a segment every rank
  maps, the same bytes for all. FSDP2's own copy-in writes each rank's shard straight
  into the one output the others read, so the call is a barrier: no rank copies
  another's shard, and no fresh pages are faulted in.
- **reduce_scatter** (:class:`SharedReduceScatter`): each rank's input lives in its own
  region of a segment every rank maps. After a barrier each rank sums its block of every
  rank's input (in rank order) into its output and marks the inputs read; no second
  barrier (an input's owner checks the marks when it next needs the region, ``slots``
  calls later). The output is FSDP2's own (it becomes the sharded gradient).

On collectives' groups this is the default: torch_pg's global forward pre-hook calls
:func:`share_by_default` at an FSDP2 module's first forward (``COLLECTIVES_FSDP_SHARED=0``
or :func:`keep_fsdp_defaults` keep FSDP2's own calls). By hand, on any group, with slots
and a timeout of one's own::

    from collectives.torch_bridge.fsdp import share_collectives
    model = fully_shard(model)            # after every fully_shard of the model
    share_collectives(model)              # every FSDP module of it, on every rank

The ranks meet (the all_gather's only work, the reduce_scatter's first) through an
all_gather of the kind of call each is in and its number: ranks in different calls all
raise, naming them.

How buffers are reused: the k-th buffer a rank takes is in slot ``k % slots``, a
segment of its own (FSDP2 calls in the same order on every rank, so the ranks agree
without a message). A rank marks its use of a slot done when FSDP2 drops the buffer (its
last view's storage is freed), and, for a reduce_scatter, marks the slot's inputs read
once it has summed its block of them. A rank that comes back to a slot first checks that
it dropped its own last buffer there (else it raises at once, or with ``fallback``, the
default path's, takes a buffer of its own for that call), then waits until every
rank has dropped the slot's all_gather output, or read its reduce_scatter inputs, and
raises if that takes longer than ``timeout`` (a rank that died or stopped, or a program
that kept a buffer). A slot grows (a new segment; rank 0 names it to the others with an
all_gather) when a call needs more than it holds; its old segment lives until the last
buffer in it is dropped. Segments are unlinked as soon as every rank has mapped them;
their pages are reserved when they are made, and where /dev/shm has no room the slots
are off on every rank (FSDP2's own calls, a RuntimeWarning).

Where the group's ranks are not on one host, or the device is not the CPU, the calls are
FSDP2's defaults: every rank takes the same path, decided once by a gather of the ranks'
host identities (the default backend's: hostname, boot and IPC namespace, or
``COLLECTIVES_HOST_ID``). A reduce_scatter whose op is neither SUM nor AVG, or whose
dtype the kernels lack (float8), runs as FSDP2's default on the shared input.
"""
import errno
import math
import mmap
import os
import secrets
import threading
import time
import warnings
import weakref

import numpy as np
import torch
import torch.distributed as td

from .. import config
from ..backends.select import host_identity
from ..core.dtypes import SUM
from ..core.tensors import dtype_code
from .torch_work import TorchWork

try:  # FSDP2's interfaces for them (torch 2.7 on; not exported by name)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # an older torch: no set_custom_all_gather to hand them to either
    AllGather = ReduceScatter = object

try:  # dst = src_0 + src_1 + ... in one chunked pass, the GIL released
    from ..engines._core import reduce_many_ptr
except ImportError:  # extensions not built: their NumPy twin (the same bits)
    from ..core.kernels_numpy import reduce_many_ptr


#: torch's names for FSDP2's calls (2.13 deprecates the older ones)
_all_gather = getattr(td, "all_gather_single", td.all_gather_into_tensor)
_reduce_scatter = getattr(td, "reduce_scatter_single", td.reduce_scatter_tensor)

#: bytes of a slot segment's header: one 64-byte line per rank, int64 counts of the slot's
#: uses it has finished: [DROPPED] its buffer freed, [READ] every rank's input summed
_LINE = 64
DROPPED, READ = 0, 1
#: the kinds of call a rank says it is in when the ranks meet (see _Slots.meet)
ALL_GATHER, REDUCE_SCATTER = 1, 2
_KINDS = {ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter"}
#: slot capacities are rounded up to this (a segment is made for a size class, not a call)
_ROUND = 1 << 21
#: orders a rank's reads of a buffer before its release mark (an acquire and a release)
_FENCE = threading.Lock()


def _create_segment(size):
    """A new file of ``size`` bytes in /dev/shm, its pages reserved; its path, or None where
    the tmpfs has no room."""
    path = f"/dev/shm/collectives-fsdp-{os.getuid()}-{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate there: its size alone
            os.ftruncate(fd, size)
        else:
            os.unlink(path)
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                return None
            raise
    finally:
        os.close(fd)
    return path


def _dtype_code(t):
    """The kernels' code for ``t``'s dtype, or None where they have none (float8, ...)."""
    try:
        return dtype_code(t)
    except TypeError:
        return None


def _numel(size):
    return math.prod(int(d) for d in size)


def _same_group(a, b):
    """Whether two torch process groups are the same (one object, or one registered name)."""
    if a is b:
        return True
    name = getattr(a, "group_name", None)
    return name is not None and name == getattr(b, "group_name", None)


def _release(released, rank, count):
    """A rank dropped its buffer in a slot: its reads of it are done."""
    with _FENCE:  # the reads of the buffer come before the mark (release order)
        released[rank, DROPPED] = count


class _Slot:
    """One segment all ranks map: a header of per-rank release counts, then ``regions``
    regions of ``capacity`` bytes (one for all ranks, or one a rank)."""

    def __init__(self, buf, capacity, world, regions):
        self.buf = buf
        self.capacity = capacity
        self.header = world * _LINE
        self.released = np.frombuffer(buf, dtype=np.int64, count=world * _LINE // 8).reshape(world, -1)
        self.base = np.frombuffer(buf, dtype=np.uint8, count=1, offset=self.header).ctypes.data
        self.end = self.base + regions * capacity
        self.uses = 0  # this rank's uses so far (the same count on every rank)

    def mark_read(self, rank):
        """This rank has summed its block of every rank's input in the slot's latest use."""
        with _FENCE:  # the reads come before the mark
            self.released[rank, READ] = self.uses

    def region(self, q):
        """Where region ``q`` starts in the segment (bytes)."""
        return self.header + q * self.capacity


class _Slots:
    """The slots of one shared collective (see the module's docstring): ``per_rank``
    gives every rank a region of its own in each slot; ``done`` is the count every rank
    must have reached before a slot's next use (DROPPED or READ); ``kind`` is what the
    rank says it is in when the ranks meet (a key of ``_KINDS``). With ``fallback``, a
    rank that still holds its own last buffer in the slot a call needs gets a buffer of
    its own for that call (``torch.empty``) instead of an error."""

    def __init__(self, name, group, slots, timeout, per_rank, done, kind, fallback=False):
        if not isinstance(slots, int) or slots < 2:
            raise ValueError(f"slots must be an int of at least 2, got {slots!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.name, self.timeout = name, float(timeout)
        self.group = group if group is not None else td.group.WORLD
        self.per_rank, self.done, self.kind, self.fallback = per_rank, done, kind, fallback
        self.slots = [None] * slots
        self.calls = 0
        self.shared = None  # decided at the first call: every rank on one host
        self.taken = 0  # buffers handed out from the slots (for tests and benches)
        self.fell_back = 0  # calls that got a buffer of their own (``fallback``)
        self._rank = self._world = None
        self._sig = self._sigs = None

    def rank(self):
        if self._rank is None:  # (a group's ranks never change)
            self._rank = td.get_rank(self.group)
        return self._rank

    def world(self):
        if self._world is None:
            self._world = td.get_world_size(self.group)
        return self._world

    def meet(self, group):
        """The call's synchronisation: once it returns, every rank of ``group`` has written
        its part. It is an all_gather of (kind, call number) from every rank, so ranks in
        different calls (a shared all_gather against a shared reduce_scatter, or one call
        apart) make every rank raise, naming what each rank was in, instead of reading
        each other's buffers."""
        if self._sig is None:
            self._sig = torch.zeros(2, dtype=torch.int64)
            self._sigs = torch.zeros(2 * self.world(), dtype=torch.int64)  # (torch gloo: flat)
        mine, theirs = self._sig.numpy(), self._sigs.numpy().reshape(-1, 2)
        mine[:] = self.kind, self.calls
        _all_gather(self._sigs, self._sig, group=group)
        if not (theirs == mine).all():
            self._diverged(theirs.tolist())

    def _diverged(self, calls):
        """Raise: the ranks said ``calls`` (kind, call number[, segment bytes]) a rank at
        one meeting."""
        said = "; ".join(f"group rank {q}: {_KINDS.get(int(c[0]), f'kind {c[0]}')} call {c[1]}"
                         + (f" ({c[2]} bytes)" if len(c) > 2 else "") for q, c in enumerate(calls))
        raise RuntimeError(
            f"{self.name}: the ranks of the group are in different shared calls ({said}): "
            f"FSDP2 calls them in one order on every rank, so the ranks' programs diverged")

    def usable(self, device, numel):
        """Whether this call goes through the slots: the CPU, two ranks or more (FSDP2
        calls no collective at world 1), not empty, every rank on one host (collective
        the first time)."""
        if torch.device(device).type != "cpu" or self.world() < 2 or numel == 0:
            return False
        if self.shared is None:
            ids = [None] * self.world()
            td.all_gather_object(ids, host_identity(), group=self.group)
            self.shared = len(set(ids)) == 1
        return self.shared

    def take(self, size, numel, dtype):
        """This rank's buffer of ``size`` (``numel`` elements) and ``dtype`` in the next
        slot (collective when the slot must grow), or None: the call takes a buffer of its
        own (``fallback`` and this rank still holds its last one there, or /dev/shm has
        no room for the slot)."""
        nbytes = numel * dtype.itemsize
        k = self.calls % len(self.slots)
        self.calls += 1
        slot = self.slots[k]
        if slot is None or slot.capacity < nbytes:
            slot = self._new_slot(nbytes)
            if slot is None:
                return None
            self.slots[k] = slot
        elif not self._wait_released(slot, k):
            self.fell_back += 1
            return None
        use = slot.uses
        slot.uses += 1
        rank = self.rank()
        held = np.frombuffer(slot.buf, dtype=np.uint8, count=nbytes,
                             offset=slot.region(rank if self.per_rank else 0))
        weakref.finalize(held, _release, slot.released, rank, use + 1).atexit = False
        self.taken += 1
        return torch.from_numpy(held).view(dtype).view(tuple(int(n) for n in size))

    def check_group(self, group):
        """FSDP2's call runs on ``group``: it must be the one the slots were made over."""
        if not _same_group(group if group is not None else td.group.WORLD, self.group):
            raise RuntimeError(
                f"{self.name}: FSDP2 called it on group {getattr(group, 'group_name', group)!r}, "
                f"its slots are over {getattr(self.group, 'group_name', self.group)!r}: pass "
                f"share_collectives(model, group=) the FSDP mesh's group")

    def slot_of(self, t):
        """The slot ``t``'s memory is in, or None."""
        ptr = t.data_ptr()
        for s in self.slots:
            if s is not None and s.base <= ptr < s.end:
                return s
        return None

    def _new_slot(self, nbytes):
        """Collective (every rank makes the same slot at the same call): rank 0 creates the
        segment; an all_gather of every rank's (kind, call number, size) and rank 0's name
        (ranks that differ all raise); each maps it; rank 0 unlinks it once all have.
        None on every rank where rank 0 found no room for it in /dev/shm (its pages are
        reserved up front: a full tmpfs would otherwise kill a rank with SIGBUS at its
        first write): the slots are then off for good, and FSDP2's calls its own."""
        world = self.world()
        capacity = max(1, -(-nbytes // _ROUND)) * _ROUND
        regions = world if self.per_rank else 1
        size = world * _LINE + regions * capacity
        made = _create_segment(size) if self.rank() == 0 else None  # rank 0's, to unlink
        try:  # every rank's (kind, call number, size), and rank 0's segment
            said = [None] * world
            td.all_gather_object(said, (self.kind, self.calls, size, made), group=self.group)
            if any(s[:3] != said[0][:3] for s in said):
                self._diverged([s[:3] for s in said])
            path = said[0][3]
            if path is None:
                self.shared = False
                warnings.warn(f"{self.name}: /dev/shm has no room for a {size}-byte segment; "
                              f"FSDP2's own calls from here on", RuntimeWarning, stacklevel=3)
                return None
            fd = os.open(path, os.O_RDWR)
            try:
                buf = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            td.barrier(group=self.group)  # every rank has mapped it
        finally:
            if made is not None:
                os.unlink(made)
        return _Slot(buf, capacity, world, regions)

    def _wait_released(self, slot, k):
        """Until every rank is done with the slot's previous use (``self.done``): True. False
        at once where this rank still holds its own last buffer there (``fallback``; else
        that raises)."""
        mine = self.rank()
        if slot.released[mine, DROPPED] < slot.uses:
            if self.fallback:
                return False
            raise RuntimeError(
                f"{self.name}: this rank (group rank {mine}) still holds its buffer "
                f"{self.calls - 1 - len(self.slots)} (slot {k}) as its buffer "
                f"{self.calls - 1} needs the slot: keep at most {len(self.slots) - 1} alive, "
                f"or pass slots= more")
        deadline = time.monotonic() + self.timeout
        spins = 0
        while True:
            behind = np.nonzero(slot.released[:, self.done] < slot.uses)[0]
            if not len(behind):
                with _FENCE:  # order the checks before this rank's writes into the slot
                    return True
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name}: group rank(s) {behind.tolist()} did not "
                    f"{'drop their buffer' if self.done == DROPPED else 'read the inputs'} "
                    f"in slot {k} within {self.timeout} s (a rank died or stopped, or keeps "
                    f"the buffer)")
            spins += 1
            time.sleep(0 if spins < 100 else 50e-6)


class SharedAllGather(AllGather):
    """FSDP2's all_gather (``FSDPModule.set_custom_all_gather``) into outputs that every
    rank of ``group`` maps; see the module's docstring. ``group`` is the FSDP mesh's group
    (None: the default group), ``slots`` how many outputs may be alive at once (FSDP2
    holds at most two: the current layer's and a prefetched one), ``timeout`` how long a
    rank waits for the others to drop an output before raising."""

    def __init__(self, group=None, slots=4, timeout=300.0, fallback=False):
        self._slots = _Slots("SharedAllGather", group, slots, timeout, per_rank=False,
                             done=DROPPED, kind=ALL_GATHER, fallback=fallback)

    @property
    def shared_calls(self):
        """Outputs handed out from shared memory so far."""
        return self._slots.taken

    def allocate(self, size, *, dtype, device):
        numel = _numel(size)
        held = self._slots.take(size, numel, dtype) if self._slots.usable(device, numel) else None
        return torch.empty(size, dtype=dtype, device=device) if held is None else held

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if self._slots.slot_of(output_tensor) is None:
            return _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
        self._slots.check_group(group)
        n = input_tensor.numel()
        block = output_tensor.view(-1).narrow(0, n * self._slots.rank(), n)
        if block.data_ptr() != input_tensor.data_ptr():  # not FSDP2's in-place form
            block.copy_(input_tensor.view(-1))
        self._slots.meet(group)  # every rank's block is in the one output
        return TorchWork(None, [output_tensor]) if async_op else None


class SharedReduceScatter(ReduceScatter):
    """FSDP2's reduce_scatter (``FSDPModule.set_custom_reduce_scatter``) from inputs in
    regions every rank of ``group`` maps; see the module's docstring. FSDP2 takes two
    buffers a call: the input (from the slots) and then the output (``torch.empty``: it
    becomes the sharded gradient and lives on). ``slots`` is how many inputs may be alive
    at once (FSDP2 keeps the previous layer's until the next call)."""

    def __init__(self, group=None, slots=4, timeout=300.0, fallback=False):
        self._slots = _Slots("SharedReduceScatter", group, slots, timeout, per_rank=True,
                             done=READ, kind=REDUCE_SCATTER, fallback=fallback)
        self._output_numel = None  # the size of the output the next allocate is for

    @property
    def shared_calls(self):
        """Inputs handed out from shared memory so far."""
        return self._slots.taken

    def allocate(self, size, *, dtype, device):
        numel = _numel(size)
        if numel == self._output_numel or not self._slots.usable(device, numel):
            self._output_numel = None
            return torch.empty(size, dtype=dtype, device=device)
        world = self._slots.world()
        self._output_numel = numel // world if numel % world == 0 else None
        held = self._slots.take(size, numel, dtype)
        return torch.empty(size, dtype=dtype, device=device) if held is None else held

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        slot = self._slots.slot_of(input_tensor)
        if slot is None:
            return _reduce_scatter(output_tensor, input_tensor, op=op, group=group,
                                   async_op=async_op)
        self._slots.check_group(group)
        code = _dtype_code(output_tensor)
        if op not in (td.ReduceOp.SUM, td.ReduceOp.AVG) or code is None:  # torch's, same input
            _reduce_scatter(output_tensor, input_tensor, op=op, group=group)
            slot.mark_read(self._slots.rank())
            return TorchWork(None, [output_tensor]) if async_op else None
        world, rank = self._slots.world(), self._slots.rank()
        n = output_tensor.numel()
        # block ``rank`` of each rank's input: its address in rank q's region
        block = (input_tensor.data_ptr() - slot.base - rank * slot.capacity
                 + n * rank * input_tensor.element_size())
        out = output_tensor.view(-1)
        self._slots.meet(group)  # every rank's input is written
        if n:  # one pass, in rank order (the same bits as adding them one by one)
            reduce_many_ptr(out.data_ptr(), [slot.base + q * slot.capacity + block
                                             for q in range(world)], n, code, SUM)
        slot.mark_read(rank)
        if op == td.ReduceOp.AVG:
            out.div_(world)
        return TorchWork(None, [output_tensor]) if async_op else None


def share_collectives(module, group=None, slots=4, timeout=300.0, reduce_scatter=True):
    """Give every FSDP2 module in ``module`` (``fully_shard``'s, itself included) one
    :class:`SharedAllGather` and, with ``reduce_scatter``, one
    :class:`SharedReduceScatter` over ``group`` (None: the FSDP mesh's group, which must
    be one for all the modules); returns them (the second None without). Call it on
    every rank, after the model's ``fully_shard`` calls and before its first forward."""
    from torch.distributed.fsdp import FSDPModule
    found = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not found:
        raise ValueError("module has no FSDP2 module in it: call fully_shard first")
    group = _fsdp_group(found, group)
    gather = SharedAllGather(group, slots, timeout)
    scatter = SharedReduceScatter(group, slots, timeout) if reduce_scatter else None
    for m in found:
        m.set_custom_all_gather(gather)
        if scatter is not None:
            m.set_custom_reduce_scatter(scatter)
    return gather, scatter


def _fsdp_group(found, group):
    """The one group the FSDP2 modules ``found`` run their calls on (read from FSDP2's
    parameter groups), checked against ``group`` (None: take it). Where FSDP2's state is
    not readable (another torch), ``group`` as given: the calls check it."""
    try:
        param_groups = [pg for m in found for pg in m._get_fsdp_state()._fsdp_param_groups]
        meshes = [pg.mesh_info for pg in param_groups]
        shard = [mi.shard_process_group for mi in meshes]
        partial = [pg for pg in param_groups if pg._use_post_forward_mesh]
    except AttributeError:
        return group
    if partial:
        raise ValueError("module: fully_shard(reshard_after_forward=<int>) all_gathers over a "
                         "second group after the forward; share_collectives takes one")
    names = {getattr(g, "group_name", id(g)) for g in shard}
    if len(names) > 1:
        raise ValueError(f"module: its FSDP2 modules run on {len(names)} process groups; "
                         f"share_collectives takes the modules of one mesh")
    if not shard:
        return group
    if group is not None and not _same_group(group, shard[0]):
        raise ValueError(f"group must be the FSDP mesh's group "
                         f"({getattr(shard[0], 'group_name', shard[0])!r}), got "
                         f"{getattr(group, 'group_name', group)!r}")
    return shard[0]


def share_all_gathers(module, group=None, slots=4, timeout=300.0):
    """:func:`share_collectives` for the all_gathers alone; returns the SharedAllGather."""
    return share_collectives(module, group, slots, timeout, reduce_scatter=False)[0]


# ---- by default: FSDP2 on collectives' groups ------------------------------------------------

#: the FSDP2 modules the default path has looked at (shared or left alone)
_looked = weakref.WeakSet()


def share_by_default(module, ours):
    """At an FSDP2 module's first forward (torch_pg's global forward pre-hook calls it):
    give it, and every FSDP2 module in it not looked at yet, the shared calls of its
    mesh's group, where that group is collectives' (an instance of ``ours``), the module
    has one parameter group, no ``reshard_after_forward=<int>``, and FSDP2's own calls
    (no custom or process-group allocation set by the program); leave the others as they
    are. Every module of a group shares one :class:`SharedAllGather` and one
    :class:`SharedReduceScatter` (``slots=4``, the group's timeout) with ``fallback`` on:
    a rank that still holds its last buffer in a slot (a program that prefetches more)
    gets a buffer of its own for that call. ``COLLECTIVES_FSDP_SHARED=0`` turns it off."""
    if module in _looked:
        return
    from torch.distributed.fsdp import FSDPModule
    for m in module.modules():
        if isinstance(m, FSDPModule) and m not in _looked:
            _looked.add(m)
            comms = _default_comms(m, ours)
            if comms is not None:
                m.set_custom_all_gather(comms[0])
                m.set_custom_reduce_scatter(comms[1])


def keep_fsdp_defaults(module):
    """Leave FSDP2's own calls to every FSDP2 module in ``module`` (the default path will not
    share them); call it before the first forward."""
    from torch.distributed.fsdp import FSDPModule
    _looked.update(m for m in module.modules() if isinstance(m, FSDPModule))


def _default_comms(m, ours):
    """The shared calls for FSDP2 module ``m`` on the default path, or None (see
    :func:`share_by_default`)."""
    if not config.get("COLLECTIVES_FSDP_SHARED"):
        return None
    try:
        param_groups = m._get_fsdp_state()._fsdp_param_groups
        if len(param_groups) != 1:
            return None
        pg = param_groups[0]
        group = pg.mesh_info.shard_process_group
        if (pg._use_post_forward_mesh or not isinstance(group, ours)
                or type(pg._all_gather_comm).__name__ != "DefaultAllGather"
                or type(pg._reduce_scatter_comm).__name__ != "DefaultReduceScatter"):
            return None
    except AttributeError:  # another torch's FSDP2: leave it alone
        return None
    comms = getattr(group, "_fsdp_shared", None)
    if comms is None:
        timeout = getattr(group, "_group", group).timeout
        comms = group._fsdp_shared = (SharedAllGather(group, timeout=timeout, fallback=True),
                                      SharedReduceScatter(group, timeout=timeout, fallback=True))
    return comms
