"""``dist.breakpoint``: a debugger on one rank while the others wait (torch's)."""
import os
import pdb
import sys
from datetime import timedelta

from . import group as _g
from .collective_ops import barrier

_skipped = {}   # call site -> calls seen, for ``skip``
_count = [0]    # breakpoints entered so far (the same on every rank: SPMD)


class _Pdb(pdb.Pdb):
    """A pdb that reads from the terminal even where the launcher gave this rank no stdin."""

    def __init__(self):
        self._tty = None
        try:
            self._tty = open("/dev/tty")
        except OSError:
            pass
        super().__init__(stdin=self._tty or sys.stdin, stdout=sys.stdout)
        if self._tty is not None:
            self.use_rawinput = False


def _make_pdb():
    return _Pdb()


def breakpoint(rank=0, skip=0, timeout_s=3600):  # noqa: A001  (torch's name)
    """Stop in pdb on ``rank`` only; every other rank waits until it continues.

    Args:
        rank: the global rank that breaks (default 0).
        skip: let the first ``skip`` calls from this line pass without stopping.
        timeout_s: how long the other ranks wait for the debugging rank, in seconds
            (default an hour; None: the default group's timeout). They wait on the
            rendezvous store, so the group timeout does not cut a session short; a world
            without a store (the mpi backend) waits in a barrier instead.

    In pdb, ``up`` goes to the frame that called ``dist.breakpoint``; ``continue`` lets
    every rank go on.
    """
    pg = _g.default_group()
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < pg.size():
        raise ValueError(f"rank must be a global rank in [0, {pg.size()}), got {rank!r}")
    if not isinstance(skip, int) or isinstance(skip, bool) or skip < 0:
        raise ValueError(f"skip must be an int >= 0, got {skip!r}")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or timeout_s <= 0):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
    if skip > 0:
        caller = sys._getframe(1)
        site = (caller.f_code.co_filename, caller.f_lineno)
        _skipped[site] = _skipped.get(site, 0) + 1
        if _skipped[site] <= skip:
            return
    _count[0] += 1
    key = f"breakpoint/{_count[0]}"
    store = _g.world.store
    if pg.rank() == rank:
        debugger = _make_pdb()
        debugger.message(f"\n!!! ATTENTION !!!\n\nrank {rank} stopped; the other ranks wait. "
                         f"Type 'up' to get to the frame that called dist.breakpoint(rank={rank})\n")
        debugger.set_trace(sys._getframe(0))
        if store is not None:  # the line pdb stops on: 'continue' releases the others
            store.set(key, str(os.getpid()))
    elif store is not None:
        wait = pg.timeout if timeout_s is None else timeout_s
        store.wait([key], timedelta(seconds=wait))
    barrier()
