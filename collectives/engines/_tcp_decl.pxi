# C declarations of collectives/engines/tcp/tcp_engine.h (all callable without the GIL).
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t


cdef extern from "tcp/tcp_engine.h" nogil:
    ctypedef struct tcp_engine:
        pass
    ctypedef struct tcp_req:
        pass

    enum:
        TCP_WIRE_VERSION
        TCP_NO_DTYPE
        TCP_TUNE_SPIN_US
        TCP_TUNE_ALLREDUCE_RD_MAX
        TCP_TUNE_BCAST_TREE_MAX
        TCP_TUNE_SEGMENT
        TCP_TUNE_GATHER_DIRECT_MAX
        TCP_TUNE_ALLREDUCE_DIRECT_WORLD
        TCP_TUNE_DUPLEX_CHUNK
        TCP_TUNE_LOWAT
        TCP_TUNE_FP_DIRECT_WORLD
        TCP_TUNE_SEG_SPLIT
        TCP_TUNE_ALLREDUCE_HD_MAX

    tcp_engine *tcp_engine_new(int rank, int size, const int *fds, uint32_t group, double timeout_s)
    void tcp_set_tuning(tcp_engine *e, int key, int64_t value)
    int64_t tcp_get_tuning(tcp_engine *e, int key)
    void tcp_set_timeout(tcp_engine *e, double timeout_s)
    int tcp_set_rank_names(tcp_engine *e, const int *names)
    void tcp_engine_close(tcp_engine *e)
    void tcp_engine_free(tcp_engine *e)
    uint64_t tcp_engine_seq(tcp_engine *e)
    int tcp_mismatch(tcp_engine *e, uint64_t *seq, int *a, uint64_t *fp_a, int *b, uint64_t *fp_b)
    void tcp_fail_next(tcp_engine *e, const char *text)
    void tcp_set_seq_shift(tcp_engine *e, int shift)
    void tcp_number_next(tcp_engine *e, uint64_t seq)
    void tcp_wire_header(unsigned char *out, int ftype, int kind, int dtype, uint32_t group,
                         int32_t tag, uint64_t seq, uint64_t fp, uint64_t aux, uint64_t len)
    void tcp_wire_header_parse(const unsigned char *inp, uint64_t *fields)

    tcp_req *tcp_isend(tcp_engine *e, const void *buf, size_t len, int dtype, int dst, int32_t tag,
                       char *err, size_t errlen)
    tcp_req *tcp_irecv(tcp_engine *e, void *buf, size_t len, int dtype, int src, int32_t tag,
                       char *err, size_t errlen)
    int tcp_req_wait(tcp_engine *e, tcp_req *r, double timeout_s, char *err, size_t errlen)
    int tcp_req_test(tcp_engine *e, tcp_req *r, char *err, size_t errlen)
    int tcp_req_source(tcp_req *r)
    size_t tcp_req_nbytes(tcp_req *r)
    void tcp_req_free(tcp_engine *e, tcp_req *r)

    int tcp_barrier(tcp_engine *e, uint64_t fp, char *err, size_t errlen)
    int tcp_broadcast(tcp_engine *e, void *buf, size_t nbytes, int root, uint64_t fp, char *err,
                      size_t errlen)
    int tcp_allreduce(tcp_engine *e, void *buf, size_t count, int dtype, int op, uint64_t fp,
                      char *err, size_t errlen)
    int tcp_reduce(tcp_engine *e, void *buf, size_t count, int dtype, int op, int root, uint64_t fp,
                   char *err, size_t errlen)
    int tcp_allgather(tcp_engine *e, void *out, const void *inp, size_t nbytes, uint64_t fp,
                      char *err, size_t errlen)
    int tcp_gather(tcp_engine *e, void *out, const void *inp, size_t nbytes, int root, uint64_t fp,
                   char *err, size_t errlen)
    int tcp_scatter(tcp_engine *e, void *out, const void *inp, size_t nbytes, int root, uint64_t fp,
                    char *err, size_t errlen)
    int tcp_reduce_scatter(tcp_engine *e, void *out, const void *inp, size_t count, int dtype, int op,
                           uint64_t fp, char *err, size_t errlen)
    int tcp_alltoall(tcp_engine *e, void *out, const void *inp, const size_t *out_bytes,
                     const size_t *in_bytes, uint64_t fp, char *err, size_t errlen)
