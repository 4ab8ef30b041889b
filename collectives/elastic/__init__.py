"""Elastic training in place: survivors keep training when a process dies, newcomers join,
and no process is restarted (Horovod Elastic's API over collectives).

::

    import collectives as dist
    from collectives import elastic

    elastic.init()                          # the store: COLLECTIVES_ELASTIC_STORE
    state = elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                             # collectives on the default group
            state.commit()

    train(state)

On a DistError (a peer died) every member gives up the work under way, the members
that are left form the next generation (a new default group), ``restore()`` the last
commit, ``sync()`` from the new rank 0, run the reset callbacks and call the function
again. Newcomers are admitted at the members' next ``commit()``. See docs/elastic.md.
"""
import functools
import gc

from ..core.errors import DistError
from .runtime import ElasticError, HostsUpdatedInterrupt, current, init, shutdown
from .state import ObjectState, State, TorchState

__all__ = ["init", "run", "State", "ObjectState", "TorchState", "ElasticError",
           "HostsUpdatedInterrupt", "generation", "members", "resets", "shutdown"]


def run(func):
    """Run ``func(state, ...)`` until it returns, through failures and newcomers.

    Before the first call the state is synced from rank 0 (a newcomer receives it). When
    the call raises a DistError: the generation is marked broken (every member's groups
    fail at once), the members left form the next one, ``state.restore()``,
    ``state.sync()``, the reset callbacks, and ``func`` is called again. When it raises
    HostsUpdatedInterrupt (from ``commit``): the same, with the newcomers, without
    ``restore`` (the state was just committed). ElasticError (too few members for too
    long) ends it.
    """
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        rt = current()
        reset = restore = False
        while True:
            try:
                if reset:
                    # what the failed call left in reference cycles (its traceback's frames,
                    # a DDP whose reducer's hooks are still on the parameters) goes now
                    gc.collect()
                    rt.reset()
                    if restore:
                        state.restore()
                state.sync()
                if reset:
                    state.on_reset()
                out = func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:
                reset = True
                continue
            except Exception as e:  # noqa: BLE001  (ours, or torch's wrapping of ours)
                if not _a_failure(e, rt):
                    raise
                rt.break_generation()
                reset = restore = True
                continue
            rt.finish()
            return out
    return wrapper


_OURS = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")


def _a_failure(e, rt):
    """Whether ``e`` comes from a lost peer: a DistError; or another error (torch turns
    the DistError of a DDP bucket's all_reduce into a RuntimeError) that names one, or
    that arrives while the generation is marked broken."""
    if isinstance(e, DistError):
        return True
    if isinstance(e, ElasticError):
        return False
    text = str(e)
    return any(name in text for name in _OURS) or rt.broken(wait=1.0)


def generation():
    """The current generation's number (0 for the job's first default group)."""
    return current().gen


def members():
    """The current generation's process ids, in rank order."""
    return list(current().members)


def resets():
    """How many times this process formed a new generation after joining."""
    return current().resets
