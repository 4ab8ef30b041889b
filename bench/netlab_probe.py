#!/usr/bin/env python3
"""Raw TCP streams between the hosts of bench/netlab.py: what the links and this kernel
give without any library, as a ceiling for the collectives measured over them.

Run by ``netlab.py --probe`` on every host of the lab at once. Host i streams ``--bytes``
``--reps`` times to host ``(i + 1) % hosts`` (pattern ``ring``: every link carries one
stream each way, as in a ring all_gather, or at 2 hosts an exchange), or only host 0 to
host 1 (``oneway``: one stream, the other direction idle but for its ACKs). A sender
times its stream from the start time it is given (every host starts together) to the
receiver's one-byte acknowledgement of the last byte, after one untimed warm-up
transfer, and prints ``{"host": i, "seconds": s, "bytes": b}`` as one JSON line.
"""
import argparse
import json
import socket
import threading
import time

PORT = 5599


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", type=int, required=True, help="this host's index")
    ap.add_argument("--hosts", type=int, required=True)
    ap.add_argument("--subnet", required=True, help="host i is <subnet>.<i + 1>")
    ap.add_argument("--pattern", choices=("ring", "oneway"), required=True)
    ap.add_argument("--bytes", type=int, default=16 << 20)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--start", type=float, required=True, help="time.time() to start at")
    args = ap.parse_args(argv)
    i, n = args.host, args.hosts
    sends = args.pattern == "ring" or i == 0
    recvs = args.pattern == "ring" or i == 1
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("0.0.0.0", PORT))
    ls.listen(1)
    out = None
    if sends:
        dest = f"{args.subnet}.{(i + 1) % n + 1}"
        deadline = time.monotonic() + 30
        while out is None:
            try:
                out = socket.create_connection((dest, PORT), timeout=30)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    inn = ls.accept()[0] if recvs else None
    buf = bytearray(args.bytes)
    got_buf = memoryview(bytearray(args.bytes))
    result = {}

    def receive():
        for _ in range(args.reps + 1):
            got = 0
            while got < args.bytes:
                k = inn.recv_into(got_buf[got:], args.bytes - got)
                if not k:
                    raise ConnectionError("the sender closed early")
                got += k
            inn.sendall(b"k")

    def send():
        out.sendall(buf)  # warm-up: opens the congestion window
        out.recv(1)
        time.sleep(max(0.0, args.start - time.time()))
        t0 = time.perf_counter()
        for _ in range(args.reps):
            out.sendall(buf)
            out.recv(1)
        result["seconds"] = time.perf_counter() - t0

    threads = [threading.Thread(target=f) for f, on in ((receive, recvs), (send, sends)) if on]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if sends:
        print(json.dumps({"host": i, "seconds": result["seconds"],
                          "bytes": args.bytes * args.reps}), flush=True)


if __name__ == "__main__":
    main()
