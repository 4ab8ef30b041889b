"""Key-value stores for rendezvous, with torch.distributed's Store API.

``TCPStore`` (a server thread on rank 0, clients everywhere), ``FileStore`` (an
append-only log in a shared file), ``HashStore`` (one process) and
``PrefixStore`` (a namespace inside another store). Keys are str, values bytes
(str is accepted and UTF-8 encoded). ``get`` and ``wait`` block until the keys
exist or the timeout passes, then raise :class:`~collectives.core.errors.DistStoreError`
naming the keys. Timeouts are ``datetime.timedelta`` (as torch) or float seconds;
zero means no timeout, as torch's ``kNoTimeout``.

Example:
    >>> server = TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    >>> server.set("k", "v"); server.get("k")
    b'v'
"""
from .base import DEFAULT_TIMEOUT, QueueEmptyError, Store, to_seconds
from .file import FileStore
from .hash import HashStore
from .prefix import PrefixStore
from .server import StoreServer, _Waiter  # noqa: F401  (tests reach the server's parts)
from .tcp import TCPStore
from .wire import (  # noqa: F401  (the protocol, for tests and tools that speak it)
    MAX_FRAME, OP_ADD, OP_APPEND, OP_CAS, OP_CHECK, OP_DELETE, OP_GET, OP_LEASE, OP_LIST_KEYS,
    OP_MULTI_GET,
    OP_MULTI_SET, OP_NUM_KEYS, OP_PING, OP_QUEUE_LEN, OP_QUEUE_POP, OP_QUEUE_PUSH, OP_SET, OP_WAIT,
    PROTOCOL_VERSION, SERVER_LINGER, ST_ERROR, ST_OK, ST_REJECTED, ST_TIMEOUT, encode_request,
)

__all__ = ["Store", "TCPStore", "FileStore", "HashStore", "PrefixStore", "StoreServer", "QueueEmptyError",
           "DEFAULT_TIMEOUT", "to_seconds"]
