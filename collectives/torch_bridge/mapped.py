"""DDP's gradient buckets in memory every rank of the host maps.

DDP's reducer all_reduces the same bucket tensors every step. On the shared-memory
backend an all_reduce otherwise moves each bucket through the group's segment (copied in,
reduced, copied out), or reads and writes the peers' buckets with one system call per
chunk (process_vm_readv/writev, ``COLLECTIVES_SHM_CMA_AR_MIN``), where the kernel pins
every page of both sides on every call. Here a bucket moves once into shared memory
(torch's ``share_memory_``: the storage's data moves, every view of it follows) and every
rank maps every other rank's; from then on the engine's mapped all_reduce
(``engines/shm/shm_mapped.c``) reduces each rank's slice straight from the others' buckets
and writes the result straight into them: an all_reduce's least memory traffic, no
system call.

Which tensors: the one tensor of an ``allreduce`` that torch calls during a backward pass
(DDP's reducer does), on a group whose backend is shared memory, a CPU tensor of at least
``COLLECTIVES_SHM_MAP_MIN`` bytes (rank 0's; 0: off) that is the whole of a storage torch
allocated (resizable, not shared yet), at its second such all_reduce (DDP rebuilds its
buckets after the first step, so the buckets that last are the ones that move). Moving
one is collective: every rank moves its bucket, the ranks exchange where each bucket lives
(process id and descriptor) and map the others' through ``/proc/<pid>/fd``; where a rank
cannot (no room in /dev/shm, no access), no rank registers it and the group stops trying.
A registered bucket that dies (the model's end) is unregistered on its rank, which drops
its mappings of the others' buckets of that id (theirs of its own go when their bucket
dies); the ranks' next all_reduce on it agrees to go the usual way. A program moves and
maps a buffer of its own with :func:`register`.
"""
import mmap
import os
import weakref

import numpy as np
import torch

#: how many buffers a group's engine holds registered at once (engines/shm: MAPPED_MAX; a
#: dead bucket's place is taken again), and how many ids a group can give out (the 23 bits
#: MAPPED_WORD has for one)
_MAX = 64
_IDS = 1 << 23


class _State:
    """One shared-memory group's mapped buckets."""

    def __init__(self):
        self.seen = {}        # data_ptr -> all_reduces seen of the live eligible tensor there
        self.live = set()     # data_ptrs of this rank's registered buckets
        self.maps = {}        # id -> the peers' mappings (while this rank's bucket lives)
        self.next_id = 0
        self.off = False      # a registration failed: the group stops trying


_states = weakref.WeakKeyDictionary()


def _state_of(backend):
    state = _states.get(backend)
    if state is None:
        state = _states[backend] = _State()
    return state


def register(tensor, group=None):
    """Collective: move ``tensor``'s storage into shared memory now, map every other
    rank's, and register them with ``group``'s engine, as DDP's buckets are at their second
    all_reduce; from then on an all_reduce on ``tensor`` or a view of it takes the mapped
    path when every rank calls on the same registered buffer at the same offset.

    Every rank of ``group`` (a shared-memory group; None: the default group) calls it with
    its own tensor of the same size: a contiguous CPU tensor that is the whole of a storage
    torch allocated and has not been shared. Returns whether it was registered, the same on
    every rank: False where a rank could not move or map it (no room in /dev/shm, no
    access), or after an earlier failure on the group (which then stops trying). Its
    ``data_ptr()`` changes once; the registration ends when the tensor dies.
    """
    from ..core.world import resolve
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    pg = resolve(group)
    if pg is None:
        raise ValueError("group must be a group this rank belongs to")
    backend = pg.backend
    if not hasattr(backend, "map_register"):
        raise ValueError(f"group must be a shared-memory group; its backend is "
                         f"{type(backend).__name__}")
    if tensor.layout != torch.strided or not _eligible(tensor, 1):
        raise ValueError("tensor must be a contiguous CPU tensor that is the whole of an "
                         "unshared storage torch allocated (not NumPy's, not a view of part "
                         "of one, not shared or registered already)")
    state = _state_of(backend)
    return not state.off and _register(pg, backend, tensor, state, strict=True)


def _eligible(t, min_bytes):
    """Whether ``t`` may move: a contiguous CPU tensor of ``min_bytes`` or more that is the
    whole of a storage torch allocated and has not shared yet."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.storage_offset():
        return False
    nbytes = t.numel() * t.element_size()
    if nbytes < min_bytes:
        return False
    st = t.untyped_storage()
    return st.nbytes() == nbytes and st.resizable() and not st.is_shared()


def maybe_map(group, tensors):
    """Before ``group.allreduce(tensors)`` in a backward pass, on a shared-memory group
    (``BridgedGroup.allreduce`` checks both): move DDP's bucket into memory the ranks map,
    at its second all_reduce (see the module's docstring). Collective when it moves one
    (every rank's reducer calls on the same bucket at the same step)."""
    backend = group.backend
    t = tensors
    if isinstance(t, (list, tuple)):
        if len(t) != 1:
            return
        t = t[0]
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:  # (sparse: no data_ptr)
        return
    state = _state_of(backend)
    ptr = t.data_ptr()
    if state.off or ptr in state.live or not _eligible(t, backend.map_min):
        return
    n = state.seen.get(ptr, 0) + 1
    if n == 1:
        # a count outlives no tensor: DDP's first buckets die when it rebuilds them after
        # step 1, and a new bucket at the same address on one rank but not another would
        # else reach its second all_reduce a step early there, and that rank alone would
        # register (the ranks' next collectives then differ)
        weakref.finalize(t, state.seen.pop, ptr, None).atexit = False
    state.seen[ptr] = n
    if n == 2:
        del state.seen[ptr]
        _register(group, backend, t, state)


def _move_to_shared(t):
    """Move ``t``'s storage into shared memory (its views follow); the descriptor this
    process holds for it, or -1 where it could not (no room in /dev/shm, no descriptors).
    It asks for twice the bytes free first: a torch before 2.10 only ftruncates the file,
    and a full /dev/shm would then kill the rank with SIGBUS at the copy."""
    nbytes = t.numel() * t.element_size()
    try:
        vfs = os.statvfs("/dev/shm")
        if vfs.f_bavail * vfs.f_frsize < 2 * nbytes:
            return -1
        return t.untyped_storage()._share_fd_cpu_()[0]
    except (RuntimeError, OSError):
        return -1


def _register(group, backend, t, state, strict=False):
    """Collective: move ``t``'s storage into shared memory, map the other ranks' and
    register the bucket with the engine; on every rank (True) or on none (False).
    ``strict``: ranks whose tensors differ in size raise ValueError (all of them)."""
    from ..api.objects import all_gather_object
    world, rank = backend.size, backend.rank
    nbytes = t.numel() * t.element_size()
    fd = _move_to_shared(t) if len(state.maps) < _MAX and state.next_id < _IDS else -1
    said = [None] * world
    all_gather_object(said, (fd, os.getpid(), nbytes), group=group)
    if strict and any(n != nbytes for _, _, n in said):
        raise ValueError(f"tensor must have the same size on every rank: "
                         f"{[n for _, _, n in said]} bytes by rank")
    if any(f < 0 or n != nbytes for f, _, n in said):
        state.off = True
        return False
    maps, peers = [], [0] * world
    for q, (qfd, pid, _) in enumerate(said):
        if q == rank:
            continue
        try:
            f = os.open(f"/proc/{pid}/fd/{qfd}", os.O_RDWR)
            try:
                m = mmap.mmap(f, nbytes)
            finally:
                os.close(f)
        except OSError:
            break
        view = np.frombuffer(m, dtype=np.uint8)
        maps.append((m, view))
        peers[q] = view.ctypes.data
    ok = len(maps) == world - 1
    verdicts = [None] * world
    all_gather_object(verdicts, ok, group=group)
    if not all(verdicts):
        state.off = True
        return False
    bucket_id = state.next_id
    state.next_id += 1
    ptr = t.data_ptr()
    # its return is not needed for agreement: a rank whose engine could not take the entry
    # (its table full, no memory) names no mapped buffer at the call, and the engine's first
    # step of every all_reduce on it then declines the mapped path on every rank alike
    backend.map_register(bucket_id, ptr, nbytes, np.array(peers, dtype=np.uint64))
    state.maps[bucket_id] = maps
    state.live.add(ptr)
    weakref.finalize(t, _unregister, backend.map_unregister, state, bucket_id, ptr).atexit = False
    return True


def _unregister(unregister, state, bucket_id, ptr):
    """This rank's bucket ``bucket_id`` died: no call on it goes mapped again (this rank
    names no buffer there), so this rank's mappings of the others' are dropped; theirs of
    this rank's go when their own bucket of that id dies."""
    unregister(bucket_id)
    state.live.discard(ptr)
    state.maps.pop(bucket_id, None)
