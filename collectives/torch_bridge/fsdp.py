"""FSDP2's all_gathers into memory that every rank of one host maps (opt in, per model).

FSDP2 (``torch.distributed.fsdp.fully_shard``) allocates each all_gather's output, copies
the rank's shard into its own block of it, all_gathers in place, copies the parameters
out and drops the output. On one host the ranks can share that output instead:
:class:`SharedAllGather` hands FSDP2 outputs that live in a shared-memory segment every
rank of the group maps, the same bytes for all of them. FSDP2's own copy-in then writes
each rank's shard straight into the one output the others read, and the all_gather is a
barrier: no rank copies another's shard, and no fresh pages are faulted in a call.

    from collectives.torch_bridge.fsdp import share_all_gathers
    model = fully_shard(model)            # after every fully_shard of the model
    share_all_gathers(model)              # every FSDP module of it, on every rank

How outputs are reused: the k-th call of every rank takes slot ``k % slots``, a region of
its own segment (FSDP2 calls in the same order on every rank, so the ranks agree without
a message). A rank marks its use of a slot done when FSDP2 drops the output (its last
view's storage is freed); a rank that comes back to a slot waits until every rank has
done so, and raises if that takes longer than ``timeout`` (a rank that died, or a program
that kept an output). A slot grows (a new segment, rank 0 names it to the others with a
broadcast) when a call needs more than it holds; its old segment lives until the last
output in it is dropped. Segments are unlinked as soon as every rank has mapped them.

Where the group's ranks are not on one host, or the device is not the CPU, the calls are
FSDP2's defaults (an output from ``torch.empty``, ``all_gather_into_tensor``): every rank
takes the same path, decided once by a gather of the ranks' host identities.
"""
import mmap
import os
import secrets
import socket
import threading
import time
import weakref

import numpy as np
import torch
import torch.distributed as td

try:  # FSDP2's interface for it (torch 2.7 on; not exported by name)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
except ImportError:  # an older torch: no set_custom_all_gather to hand it to either
    AllGather = object

#: bytes of a slot segment's header: one 64-byte line per rank (its count of finished uses)
_LINE = 64
#: slot capacities are rounded up to this (a segment is made for a size class, not a call)
_ROUND = 1 << 21
#: orders a rank's reads of an output before its release mark (an acquire and a release)
_FENCE = threading.Lock()


def _host_identity():
    """What makes two ranks' /dev/shm the same: the host and its boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class _Slot:
    """One region all ranks map: a header of per-rank release counts, then the data."""

    def __init__(self, buf, capacity, world):
        self.buf = buf
        self.capacity = capacity
        self.released = np.frombuffer(buf, dtype=np.int64, count=world * _LINE // 8).reshape(world, -1)
        self.base = np.frombuffer(buf, dtype=np.uint8, count=1, offset=world * _LINE).ctypes.data
        self.header = world * _LINE
        self.uses = 0  # this rank's uses so far (the same count on every rank)


class SharedAllGather(AllGather):
    """FSDP2's all_gather (``FSDPModule.set_custom_all_gather``) into outputs that every
    rank of ``group`` maps; see the module's docstring. ``group`` is the FSDP mesh's group
    (None: the default group), ``slots`` how many outputs may be alive at once (FSDP2
    holds at most two: the current layer's and a prefetched one), ``timeout`` how long a
    rank waits for the others to drop an output before raising."""

    def __init__(self, group=None, slots=4, timeout=300.0):
        if not isinstance(slots, int) or slots < 2:
            raise ValueError(f"slots must be an int of at least 2, got {slots!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.group = group
        self.timeout = float(timeout)
        self._slots = [None] * slots
        self._calls = 0
        self._shared = None  # decided at the first call: every rank on one host
        self.shared_calls = 0  # calls that went through shared memory (for tests and benches)

    # -- FSDP2's interface ---------------------------------------------------------------
    def allocate(self, size, *, dtype, device):
        if torch.device(device).type != "cpu" or not self._one_host():
            return torch.empty(size, dtype=dtype, device=device)
        numel = 1
        for n in size:
            numel *= int(n)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        k = self._calls % len(self._slots)
        self._calls += 1
        slot = self._slots[k]
        if slot is None or slot.capacity < nbytes:
            slot = self._slots[k] = self._new_slot(nbytes)
        else:
            self._wait_released(slot, k)
        use = slot.uses
        slot.uses += 1
        held = np.frombuffer(slot.buf, dtype=np.uint8, count=nbytes, offset=slot.header)
        rank = self._rank()
        weakref.finalize(held, _release, slot.released, rank, use + 1).atexit = False
        self.shared_calls += 1
        return torch.from_numpy(held).view(dtype).view(tuple(int(n) for n in size))

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if not self._is_shared(output_tensor):
            return td.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                             async_op=async_op)
        n = input_tensor.numel()
        block = output_tensor.view(-1).narrow(0, n * td.get_rank(group), n)
        if block.data_ptr() != input_tensor.data_ptr():  # not FSDP2's in-place form
            block.copy_(input_tensor.view(-1))
        # every rank's block is in the one output once every rank has arrived
        return td.barrier(group=group, async_op=async_op)

    # -- helpers -------------------------------------------------------------------------
    def _rank(self):
        return td.get_rank(self.group)

    def _one_host(self):
        if self._shared is None:
            ids = [None] * td.get_world_size(self.group)
            td.all_gather_object(ids, _host_identity(), group=self.group)
            self._shared = len(set(ids)) == 1
        return self._shared

    def _is_shared(self, t):
        ptr = t.data_ptr()
        return any(s is not None and s.base <= ptr < s.base + s.capacity for s in self._slots)

    def _new_slot(self, nbytes):
        """Collective (every rank makes the same slot at the same call): rank 0 creates the
        segment and broadcasts its name; each maps it; rank 0 unlinks it once all have."""
        world = td.get_world_size(self.group)
        capacity = max(1, -(-nbytes // _ROUND)) * _ROUND
        size = world * _LINE + capacity
        name = [None]
        if self._rank() == 0:
            name[0] = f"/dev/shm/collectives-fsdp-{os.getuid()}-{os.getpid()}-{secrets.token_hex(6)}"
            fd = os.open(name[0], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        try:
            td.broadcast_object_list(name, src=td.get_global_rank(self.group, 0)
                                     if self.group is not None else 0, group=self.group)
            fd = os.open(name[0], os.O_RDWR)
            try:
                buf = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            td.barrier(group=self.group)  # every rank has mapped it
        finally:
            if self._rank() == 0:
                os.unlink(name[0])
        return _Slot(buf, capacity, world)

    def _wait_released(self, slot, k):
        """Until every rank has dropped its previous output in slot ``k``."""
        mine = self._rank()
        if slot.released[mine, 0] < slot.uses:
            raise RuntimeError(
                f"SharedAllGather: this rank (group rank {mine}) still holds the output of "
                f"its all_gather {self._calls - 1 - len(self._slots)} (slot {k}) as the "
                f"call {len(self._slots)} later needs the slot: keep at most "
                f"{len(self._slots) - 1} outputs alive, or pass slots= more")
        deadline = time.monotonic() + self.timeout
        spins = 0
        while True:
            behind = np.nonzero(slot.released[:, 0] < slot.uses)[0]
            if not len(behind):
                with _FENCE:  # order the checks before this rank's writes into the slot
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"SharedAllGather: group rank(s) {behind.tolist()} did not drop their "
                    f"output of slot {k} within {self.timeout} s (a rank died or stopped, "
                    f"or keeps the output)")
            spins += 1
            time.sleep(0 if spins < 100 else 50e-6)


def _release(released, rank, count):
    """A rank's output in a slot was dropped: its reads of it are done."""
    with _FENCE:  # the reads of the output come before the mark (release order)
        released[rank, 0] = count


def share_all_gathers(module, group=None, slots=4, timeout=300.0):
    """Give every FSDP2 module in ``module`` (``fully_shard``'s, itself included) one
    :class:`SharedAllGather` over ``group``; returns it. Call it on every rank, after the
    model's ``fully_shard`` calls and before its first forward."""
    from torch.distributed.fsdp import FSDPModule
    comm = SharedAllGather(group, slots, timeout)
    found = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not found:
        raise ValueError("module has no FSDP2 module in it: call fully_shard first")
    for m in found:
        m.set_custom_all_gather(comm)
    return comm
