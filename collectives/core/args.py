"""Argument checks shared by the front end, the stores and the backends: one timeout
normaliser and one tag check, so that every layer means the same by 0 and by a bad value."""
import datetime
import math

TAG_LIMIT = 2**31  # tags are ints in [0, 2**31) on every backend (mpi: up to its MPI_TAG_UB)


def timeout_seconds(timeout, name="timeout", positive=False):
    """Seconds from a timedelta, a number or None (None stays None).

    TypeError for another type; ValueError for a negative or non-finite value, or for 0
    when ``positive`` (a group's timeout: every wait must be bounded and possible).
    """
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        secs = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        secs = float(timeout)
    else:
        raise TypeError(f"{name} must be a datetime.timedelta or a number of seconds, got {timeout!r}")
    if not math.isfinite(secs) or secs < 0 or (positive and secs == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {timeout!r}")
    return secs


def wait_seconds(timeout, name="timeout"):
    """A store's or a socket's wait: :func:`timeout_seconds`, where 0 (and infinity, or
    more than sockets and condition variables take) means no timeout, returned as 0.0."""
    if isinstance(timeout, float) and timeout == math.inf:
        return 0.0
    if timeout is None:
        raise TypeError(f"{name} must be a datetime.timedelta or a number of seconds, got None")
    secs = timeout_seconds(timeout, name)
    return 0.0 if secs > 1e8 else secs


def check_tag(tag, name="tag"):
    """ValueError unless ``tag`` is an int in [0, 2**31)."""
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag < TAG_LIMIT:
        raise ValueError(f"{name} must be an int in [0, 2**31), got {tag!r}")
    return tag
