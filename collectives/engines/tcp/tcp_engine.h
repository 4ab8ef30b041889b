/* The TCP transport behind the 'gloo' backend: one connection per peer, framed
 * messages, a poll-driven full-duplex progress loop and the collective algorithms.
 *
 * Every function is thread-safe and is called with the GIL released. Functions
 * that can fail return 0 on success and -1 on failure with a message in err.
 */
#ifndef COLLECTIVES_TCP_ENGINE_H
#define COLLECTIVES_TCP_ENGINE_H
#include <stddef.h>
#include <stdint.h>

typedef struct tcp_engine tcp_engine;
typedef struct tcp_req tcp_req;

/* Every frame starts with a 48-byte little-endian header carrying this version; a frame of
 * another version is refused (the connection hello checks it first). 1 was the native-endian
 * header without a version or fingerprints. */
#define TCP_WIRE_VERSION 2
/* dtype code of bytes without a dtype (collectives.core.fingerprint.NO_DTYPE) */
#define TCP_NO_DTYPE 15

/* Tuning knobs (tcp_set_tuning keys). */
enum tcp_tuning {
    TCP_TUNE_SPIN_US = 0,          /* spin this long (poll with timeout 0) before blocking */
    TCP_TUNE_ALLREDUCE_RD_MAX = 1, /* all_reduce: recursive doubling up to this many bytes */
    TCP_TUNE_BCAST_TREE_MAX = 2,   /* broadcast/reduce: binomial tree up to this many bytes */
    TCP_TUNE_SEGMENT = 3,          /* pipelining segment in bytes */
    TCP_TUNE_GATHER_DIRECT_MAX = 4, /* all_gather/reduce_scatter: one-round direct exchange up to this */
    TCP_TUNE_ALLREDUCE_DIRECT_WORLD = 5, /* large all_reduce: direct exchange up to this world size, else ring */
    TCP_TUNE_DUPLEX_CHUNK = 6,     /* bytes per write, and per read while writes wait (0: no limit) */
    TCP_TUNE_LOWAT = 7,            /* 1: SO_RCVLOWAT wakes a large receive late (default), 0: off */
    TCP_TUNE_FP_DIRECT_WORLD = 8,  /* rooted collectives: fingerprint frames to every peer up to
                                      this world size, dissemination rounds above it */
    TCP_TUNE_SEG_SPLIT = 9,        /* pipelined steps split a block into at least this many
                                      segments (8 over links; 1 on one host, see seg_bytes) */
    TCP_TUNE_ALLREDUCE_HD_MAX = 10 /* all_reduce above RD_MAX: recursive halving-doubling up to
                                      this many bytes, above 2 ranks (0: never) */
};

/* fds[size]: connected, non-blocking sockets (fds[rank] is ignored); the engine owns them. */
tcp_engine *tcp_engine_new(int rank, int size, const int *fds, uint32_t group, double timeout_s);
void tcp_set_tuning(tcp_engine *e, int key, int64_t value);
int64_t tcp_get_tuning(tcp_engine *e, int key);
void tcp_set_timeout(tcp_engine *e, double timeout_s);
/* Name rank r as names[r] (size ints, copied; NULL: r) in messages; -1 if out of memory. */
int tcp_set_rank_names(tcp_engine *e, const int *names);
/* Flushes pending sends (bounded), tells peers, closes the sockets, fails pending requests. */
void tcp_engine_close(tcp_engine *e);
void tcp_engine_free(tcp_engine *e);
uint64_t tcp_engine_seq(tcp_engine *e);
/* The first fingerprint mismatch this engine saw or was told of: 1 and rank a called fp_a
 * where rank b called fp_b as collective seq (errors then read "{mismatch}"); 0 if none. */
int tcp_mismatch(tcp_engine *e, uint64_t *seq, int *a, uint64_t *fp_a, int *b, uint64_t *fp_b);
/* Fail the next collective on every rank with text, without taking part in it: for a
 * caller whose own part of that collective failed elsewhere (a hierarchical group's leader
 * whose host found a mismatch). This rank counts the collective as begun and failed; the
 * peers' call of it, begun or not yet, fails with "rank R reported: text". */
void tcp_fail_next(tcp_engine *e, const char *text);
/* Numbering for an engine that runs one level of another group (a hierarchical group's host
 * leaders), which may cut one of its collectives into several here: the caller's collective
 * s begins at number s << shift (tcp_number_next(e, s), every rank alike), its pieces take
 * the numbers after it, and messages name s. Set the shift once, before any collective. */
void tcp_set_seq_shift(tcp_engine *e, int shift);
void tcp_number_next(tcp_engine *e, uint64_t seq);
/* The wire encoding of a frame header (48 bytes), and its 12 fields (magic, version, ftype,
 * kind, dtype, flags, group, tag, seq, fp, aux, len) decoded from one: for tests and tools. */
void tcp_wire_header(unsigned char *out, int ftype, int kind, int dtype, uint32_t group,
                     int32_t tag, uint64_t seq, uint64_t fp, uint64_t aux, uint64_t len);
void tcp_wire_header_parse(const unsigned char *in, uint64_t *fields);

/* Point to point. src -1 = any source. NULL with err on immediate failure. A message must
 * match its receive's size exactly and its dtype (TCP_NO_DTYPE on either side: any), else
 * the receive fails naming both. */
tcp_req *tcp_isend(tcp_engine *e, const void *buf, size_t len, int dtype, int dst, int32_t tag,
                   char *err, size_t errlen);
tcp_req *tcp_irecv(tcp_engine *e, void *buf, size_t len, int dtype, int src, int32_t tag,
                   char *err, size_t errlen);
/* 0 done, -1 failed (err filled), -2 timed out (err filled; the request stays posted and
 * may be waited on again); timeout_s < 0: the engine's timeout. */
int tcp_req_wait(tcp_engine *e, tcp_req *r, double timeout_s, char *err, size_t errlen);
/* 1 done, 0 pending, -1 failed; makes non-blocking progress. */
int tcp_req_test(tcp_engine *e, tcp_req *r, char *err, size_t errlen);
int tcp_req_source(tcp_req *r);
size_t tcp_req_nbytes(tcp_req *r);
void tcp_req_free(tcp_engine *e, tcp_req *r);

/* Collectives (blocking, one at a time per engine). Sizes in bytes unless named count. fp is
 * this rank's fingerprint of the call (collectives.core.fingerprint.pack); every frame carries it,
 * and a peer's that differs fails the collective on every rank ("{mismatch}", tcp_mismatch)
 * before its data lands in or is reduced into the caller's buffer. */
int tcp_barrier(tcp_engine *e, uint64_t fp, char *err, size_t errlen);
int tcp_broadcast(tcp_engine *e, void *buf, size_t nbytes, int root, uint64_t fp, char *err, size_t errlen);
int tcp_allreduce(tcp_engine *e, void *buf, size_t count, int dtype, int op, uint64_t fp, char *err,
                  size_t errlen);
int tcp_reduce(tcp_engine *e, void *buf, size_t count, int dtype, int op, int root, uint64_t fp,
               char *err, size_t errlen);
int tcp_allgather(tcp_engine *e, void *out, const void *in, size_t nbytes, uint64_t fp, char *err,
                  size_t errlen);
int tcp_gather(tcp_engine *e, void *out, const void *in, size_t nbytes, int root, uint64_t fp, char *err,
               size_t errlen);
int tcp_scatter(tcp_engine *e, void *out, const void *in, size_t nbytes, int root, uint64_t fp, char *err,
                size_t errlen);
int tcp_reduce_scatter(tcp_engine *e, void *out, const void *in, size_t count, int dtype, int op,
                       uint64_t fp, char *err, size_t errlen);
int tcp_alltoall(tcp_engine *e, void *out, const void *in, const size_t *out_bytes,
                 const size_t *in_bytes, uint64_t fp, char *err, size_t errlen);

#endif
