"""The default backend ('gloo', alias 'tcp'): picks the transport for a group."""


def create_default_backend(store, rank, size, timeout, options=None):
    """The backend for ``init_process_group('gloo')`` and ``new_group(backend='gloo')``."""
    from .tcp import TcpBackend
    return TcpBackend(store, rank, size, timeout, options)
