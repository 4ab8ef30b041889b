"""The mpi backend's call log: the C one (collectives.engines._mpilog) against the Python one.

Both hold the fingerprints of a group's blocking calls since the ranks last compared them;
ranks compare ``digest()``, so the two must agree word for word (a rank without the
extension still matches one with it). No MPI is needed here.
"""
import functools
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives.backends.mpi.fingerprint import CallLog, FingerprintCheck, PyCallLog
from collectives.core.errors import DistBackendError

LOGS = [PyCallLog] + ([CallLog] if CallLog is not None else [])
EVERY = FingerprintCheck.CHECK_EVERY

word = st.integers(-2**40, 2**40)
entry = st.tuples(st.integers(1, 11), st.integers(0, 15), st.integers(0, 2**40), word, word)


def _fnv(entries):
    """The digest by its definition: FNV-1a over the entries' words (two's complement
    64-bit), then the final mix."""
    mask = (1 << 64) - 1
    words = [w & mask for w in itertools.chain.from_iterable(entries)]
    h = functools.reduce(lambda acc, w: ((acc ^ w) * 0x100000001b3) & mask, words,
                         0xcbf29ce484222325)
    h = ((h ^ (h >> 33)) * 0xff51afd7ed558ccd) & mask
    return h ^ (h >> 33)


@settings(max_examples=60, deadline=None)
@given(st.lists(entry, max_size=EVERY - 1))
def test_every_log_keeps_its_entries_and_digests_them_alike(entries):
    for make in LOGS:
        calls = []
        log = make(functools.partial(calls.append, 1), DistBackendError)
        for e in entries:
            log.append(e)
        assert log.entries() == entries
        assert len(log) == len(entries)
        assert log.digest() == _fnv(entries)
        assert calls == []  # not full: no comparison yet


@pytest.mark.parametrize("make", LOGS)
def test_the_full_log_compares_once_and_a_failed_one_raises(make):
    seen = []
    log = make(lambda: (seen.append(log.entries()), log.clear()), DistBackendError)
    for i in range(2 * EVERY):
        log.append((3, 1, i, -1, 0))
    assert [len(s) for s in seen] == [EVERY, EVERY]
    assert seen[1][0] == (3, 1, EVERY, -1, 0)
    log.failed = "calls differed"
    with pytest.raises(DistBackendError, match="unusable.*calls differed"):
        log.append((3, 1, 0, -1, 0))


@pytest.mark.skipif(CallLog is None, reason="collectives.engines._mpilog is not built")
@settings(max_examples=40, deadline=None)
@given(st.lists(entry, min_size=1, max_size=EVERY - 1), st.integers(0, EVERY - 2))
def test_logs_that_differ_in_one_word_digest_differently(entries, at):
    at %= len(entries)
    other = list(entries)
    k, d, c, r, o = other[at]
    other[at] = (k, d, c + 1, r, o)
    digests = []
    for log_entries in (entries, other):
        log = CallLog(lambda: None, DistBackendError)
        for e in log_entries:
            log.append(e)
        digests.append(log.digest())
    assert digests[0] != digests[1]


@pytest.mark.parametrize("make", LOGS)
def test_a_barrier_entry_is_compared_at_once(make):
    seen = []
    log = make(lambda: (seen.append(log.entries()), log.clear()), DistBackendError)
    log.append((3, 1, 4, -1, 0))
    log.append_and_compare((1, 15, 0, -1, -1))
    assert seen == [[(3, 1, 4, -1, 0), (1, 15, 0, -1, -1)]]
    log.failed = "calls differed"
    with pytest.raises(DistBackendError, match="unusable.*calls differed"):
        log.append_and_compare((1, 15, 0, -1, -1))


@pytest.mark.skipif(CallLog is None, reason="collectives.engines._mpilog is not built")
def test_a_comparison_that_raises_leaves_the_group_unusable_not_overrun():
    def compare():
        raise RuntimeError("an MPI error")  # before the log is cleared

    log = CallLog(compare, DistBackendError)
    for i in range(EVERY - 1):
        log.append((3, 1, i, -1, 0))
    with pytest.raises(RuntimeError, match="an MPI error"):
        log.append((3, 1, 0, -1, 0))
    assert len(log) == EVERY
    for call in (lambda: log.append((3, 1, 0, -1, 0)),
                 lambda: log.append_and_compare((1, 15, 0, -1, -1))):
        with pytest.raises(DistBackendError, match="unusable"):
            call()
    assert len(log) == EVERY
