"""Environment variables set for a block, in a pool's rank (where pytest's monkeypatch is
not at hand), and put back as they were."""
import contextlib
import os


@contextlib.contextmanager
def environ(values):
    """Set ``values`` (name -> str) in os.environ for the block; restore each afterwards
    (removed again where it was unset)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
