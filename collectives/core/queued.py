"""Work run through a group's queue: several calls as one queued operation (:class:`Steps`,
so async work keeps its copy-out steps), and :func:`settle`, the wait for what is queued."""


class Steps:
    """Several calls run as one queued operation (so async work keeps its copy-out steps)."""

    __slots__ = ("__name__", "steps")

    def __init__(self, name, steps):
        self.__name__ = name
        self.steps = steps

    def __call__(self):
        for fn, args in self.steps:
            fn(*args)


def _nothing():
    pass


def settle(pg):
    """Wait for ``pg``'s queued async work: an input copied at issue time must hold the value
    that issue order gives it, not one an earlier async op is still about to write."""
    pg.run(_nothing)


__all__ = ["Steps", "settle"]
