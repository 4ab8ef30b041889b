"""The two dispatchers a test runs a world's calls through: the C one and its Python twin."""
import pytest

from collectives.api import group_dispatcher


def choose(dist, which):
    """The world's group, given the C dispatcher (``which`` "c", where built: else the
    world is destroyed and the test skipped) or its pure-Python twin ("python")."""
    pg = dist.group.WORLD
    if which == "python":
        pg.dispatch = group_dispatcher._PyDispatcher(pg, pg.fr, pg.backend, pg.dispatch.inline,
                                             pg.backend.pending)
    elif group_dispatcher._Dispatcher is None:
        dist.destroy_process_group()
        pytest.skip("collectives.engines._core is not built")
    return pg
