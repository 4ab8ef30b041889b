"""Timestamps of asynchronous collectives, for a benchmark's timeline (off by default).

With ``COLLECTIVES_TIMELINE=1`` (read once, at import) every asynchronous collective
leaves four timestamps (``time.monotonic_ns``) in :data:`EVENTS`, keyed by its group's
flight-recorder sequence number:

- ``post``: the front end hands the call to the group's queue (the dispatcher's
  general path, in the issuing thread: for DDP, torch's reducer in the backward pass);
- ``start`` and ``end``: the progress thread begins and finishes the backend's call;
- ``done``: torch's future of the call is completed (what DDP's reducer waits on).

Each entry is ``(what, group name, seq, t_ns, extra)`` (``extra``: the post's byte count,
else 0). Off, the hooks cost one global test per call. :func:`take` returns the entries
and clears them; a benchmark reads them in its own process (bench/bench_train.py).
"""
import time

from .. import config

ON = config.get("COLLECTIVES_TIMELINE")
EVENTS = []  # list.append is atomic under the GIL: every thread appends here
KEYS = {}    # id(a posted call's request) -> (group name, seq), for its "done" mark
now = time.monotonic_ns


def mark(what, group, seq, extra=0):
    """Record event ``what`` of call ``seq`` of ``group`` now."""
    EVENTS.append((what, group, seq, now(), extra))


def mark_request(what, req):
    """Record event ``what`` of the call whose request is ``req`` (posted while on)."""
    key = KEYS.pop(id(req), None)
    if key is not None:
        EVENTS.append((what, key[0], key[1], now(), 0))


def take():
    """The entries recorded so far (then forgotten)."""
    out = EVENTS[:]
    del EVENTS[:len(out)]
    return out


__all__ = ["EVENTS", "KEYS", "ON", "mark", "mark_request", "now", "take"]
