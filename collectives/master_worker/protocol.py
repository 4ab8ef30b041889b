"""Opcodes, tags and sizes of the master-worker protocol (both sides import this)."""

# commands, master -> worker (tag CMD)
C_SYNC, C_SHUTDOWN, C_FREE, C_ALLOC, C_PUT, C_GET, C_META, C_CALL = 1, 2, 3, 4, 5, 6, 7, 8
C_SENDTO, C_RECVFROM, C_COLL, C_RPC, C_SEED, C_STATS, C_BIG, C_PAIR = 9, 10, 11, 12, 13, 14, 15, 16
C_CALLR, C_BIND, C_GRAD = 17, 18, 19
COMMAND_NAMES = {
    C_SYNC: "synchronize", C_SHUTDOWN: "shutdown", C_FREE: "free", C_ALLOC: "allocate",
    C_PUT: "send", C_GET: "get", C_META: "meta", C_CALL: "call", C_CALLR: "call",
    C_BIND: "bind", C_GRAD: "grad mode", C_SENDTO: "to_node (send)",
    C_RECVFROM: "to_node (receive)", C_COLL: "collective", C_RPC: "rpc", C_SEED: "manual_seed",
    C_STATS: "stats", C_BIG: "big frame", C_PAIR: "pair group",
}

# replies, worker -> master (tag REPLY): args are (payload, errors)
R_OK, R_FAIL, R_BIG = 0, 1, 2

# tags (below 32767, the least MPI_TAG_UB MPI allows): commands, replies, bulk data
# between master and worker, the continuation of an oversized frame, worker-to-worker moves
T_CMD, T_REPLY, T_DATA, T_BIG, T_REPLY_BIG, T_W2W, T_W2W_DATA = range(32001, 32008)

CMD_MAX = 16384    # a frame up to this size travels in one message
REPLY_MAX = 16384
BULK_MIN = 1 << 20  # tensors this large move master <-> worker by a broadcast in a 2-rank group
FREE_BATCH = 512   # frees of collected handles go out in batches of this many
CREDIT = 256      # the master asks for an answer every this many commands (flow control)
POLL_S = 0.5       # a waiting side checks its peer's liveness this often
