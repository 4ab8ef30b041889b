"""Call fingerprints: what a rank called, in a form every backend can exchange cheaply.

A fingerprint names one collective call of one rank: its kind, dtype code, element
count (or bytes, for the byte-only calls), root (group rank, -1 for none) and reduce op
(-1 for none). Backends carry it in data the ranks exchange anyway (the shared-memory
control line, the TCP frame header) and compare the peers' with their own before they
touch the user's buffer; a difference raises :class:`DistBackendError` on every rank,
naming both calls (:func:`mismatch_message`).

``pack`` folds the five fields into one 64-bit word for the C engines (kind 4 bits,
dtype 4 bits, op 4 bits, root 12 bits + 1, count 40 bits); ``digest`` mixes a word with
the collective's number so that equal words of different collectives differ too. Counts
past 2**40 elements and roots past 4094 are folded, so two calls that differ only there
compare equal: both are far past anything one host or a test exercises, and the DETAIL
debug mode (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) still compares the full values.
"""
from . import dtypes as D

# kind codes: the TCP engine's frame kinds (K_* in engines/tcp/tcp_internal.h, K_P2P for
# send and recv) use the same numbers, and _shm.pyx takes its codes from here
BARRIER = 1
BROADCAST = 2
ALL_REDUCE = 3
REDUCE = 4
ALL_GATHER = 5
GATHER = 6
SCATTER = 7
REDUCE_SCATTER = 8
ALL_TO_ALL = 9
SEND = 10
RECV = 11

KIND_NAMES = {BARRIER: "barrier", BROADCAST: "broadcast", ALL_REDUCE: "all_reduce",
              REDUCE: "reduce", ALL_GATHER: "all_gather", GATHER: "gather", SCATTER: "scatter",
              REDUCE_SCATTER: "reduce_scatter", ALL_TO_ALL: "all_to_all", SEND: "send",
              RECV: "recv"}
# the argument a kind's root is spelled as in torch's API
_ROOT_ARG = {BROADCAST: "src", SCATTER: "src", REDUCE: "dst", GATHER: "dst"}

NO_DTYPE = 15  # byte-only calls (barrier; raw byte moves)
_COUNT_MASK = (1 << 40) - 1


def pack(kind, dtype=NO_DTYPE, count=0, root=-1, op=-1):
    """One 64-bit word for (kind, dtype, count, root, op); the inverse is :func:`unpack`."""
    return ((kind & 0xF) | ((dtype & 0xF) << 4) | (((op + 1) & 0xF) << 8)
            | (((root + 1) & 0xFFF) << 12) | ((count & _COUNT_MASK) << 24))


def unpack(word):
    """(kind, dtype, count, root, op) of a :func:`pack` word."""
    return (word & 0xF, (word >> 4) & 0xF, (word >> 24) & _COUNT_MASK,
            ((word >> 12) & 0xFFF) - 1, ((word >> 8) & 0xF) - 1)


def describe(kind, dtype=NO_DTYPE, count=0, root=-1, op=-1):
    """``broadcast(src=1, float32, 100)``: a call as a user would have written it (the root
    as the call named it: a rank of the group the user called it on)."""
    parts = []
    if root >= 0:
        parts.append(f"{_ROOT_ARG.get(kind, 'root')}={root}")
    if dtype != NO_DTYPE:
        parts.append(D.DTYPE_NAMES.get(dtype, f"dtype {dtype}"))
    if kind not in (BARRIER, ALL_TO_ALL):  # all_to_all's counts are per peer, not in the word
        parts.append(str(count) if dtype != NO_DTYPE else f"{count} bytes")
    if op >= 0:
        parts.append(f"op={D.OP_NAMES.get(op, op)}")
    return f"{KIND_NAMES.get(kind, f'collective kind {kind}')}({', '.join(parts)})"


def describe_word(word):
    """:func:`describe` of a :func:`pack` word."""
    return describe(*unpack(word))


def mismatch_message(seq, me, mine, peer, theirs, group=None, rank_name=None):
    """The text of the error every rank raises when ``peer`` called something else.

    ``mine``/``theirs`` are pack words; ``seq`` the collective's number in the group
    (1-based); ``me``/``peer`` ranks of the engine that saw it, shown through ``rank_name``
    if given (a hierarchical group's parts name their ranks as the group's); the words'
    roots are shown as they are: every part carries the user's call, rooted in the group.
    """
    nm = rank_name if rank_name is not None else (lambda r: r)
    where = f" in group {group}" if group is not None else ""
    return (f"collectives called in a different order or with different arguments{where}: "
            f"rank {nm(peer)} called {describe_word(theirs)} as collective #{seq}; "
            f"rank {nm(me)} called {describe_word(mine)}")

