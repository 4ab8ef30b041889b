"""The elastic job's store as a process of its own: ``python -m collectives.elastic.store
--port 29400`` serves it until killed (SIGTERM/SIGINT), outside every training process.
collectives-run --min-np/--max-np serves it in its supervisor instead."""
import argparse
import signal
import sys
import threading

from ..security import auth
from ..store.server import StoreServer


def serve(port=0, host=None, auth_key=None):
    """A StoreServer in this process (a background thread); returns it (``.port``)."""
    return StoreServer(port, None, host, auth.resolve_key(auth_key))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m collectives.elastic.store",
                                description="serve an elastic job's store")
    p.add_argument("--port", type=int, default=0, help="port (0: a free one, printed)")
    p.add_argument("--host", default=None, help="address to listen on (default: every interface)")
    args = p.parse_args(argv)
    server = serve(args.port, args.host)
    print(f"collectives elastic store serving on port {server.port}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
