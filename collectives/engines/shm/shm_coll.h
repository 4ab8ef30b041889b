/* Same-host collectives over one POSIX shared-memory segment per group.
 *
 * Layout: a header page, one control block per rank (each counter on its own
 * cache line), one data slot per rank (two halves, used alternately so that
 * writing block k+1 overlaps others reading block k) and one byte ring per
 * ordered pair of ranks for point-to-point messages.
 *
 * Synchronisation uses monotonic 32-bit sequence counters (never reset): a rank
 * publishes step s by storing post = s and, after reading the step's data,
 * ack = s. A half is rewritten only after every rank acked the last step that
 * read it. Waits spin a bounded number of polls, yield, then sleep on a futex,
 * checking the peer's pid so a dead peer is an error, not a hang. Every
 * function that may wait is called with the GIL released (the *_try calls below wait a
 * bounded spin at most, with it held), and none touches Python.
 */
#ifndef COLLECTIVES_SHM_COLL_H
#define COLLECTIVES_SHM_COLL_H
#include <stddef.h>
#include <stdint.h>

/* error codes (the reduce kernels' codes -1/-2 pass through) */
#define SHM_OK 0
#define SHM_ETIMEDOUT (-10)   /* a wait ran past the timeout */
#define SHM_EPEERDEAD (-11)   /* the peer process is gone */
#define SHM_EBROKEN (-12)     /* an earlier failure left the group unusable */
#define SHM_ESYS (-13)        /* a system call failed; errno kept in sys_errno */
#define SHM_EINVAL (-14)      /* bad argument or a segment of another layout */
#define SHM_ECLOSED (-15)     /* the communicator is closed */
#define SHM_EFAILED (-16)     /* the group failed: see shm_comm_fail_record */

/* The group's first failure, recorded in the segment for every rank to report alike:
 * a fingerprint mismatch (rank a called word wa as collective k, rank b word wb), an
 * all_to_all whose rank b sends wb bytes to rank a, which expects wa, or a text. */
#define SHM_FAIL_NONE 0
#define SHM_FAIL_MISMATCH 2
#define SHM_FAIL_COUNTS 3
#define SHM_FAIL_TEXT_SET 4
#define SHM_FAIL_TEXT 1024


typedef struct shm_comm shm_comm;

/* Create (create=1) or map an existing segment called `name` (a shm_open name). */
int shm_comm_open(shm_comm **out, const char *name, int create, int rank, int size,
                  size_t half_bytes, size_t ring_bytes, double timeout_s, int *sys_errno);
void shm_comm_close(shm_comm *c);
int shm_comm_unlink(const char *name);
void shm_comm_set_timeout(shm_comm *c, double timeout_s);
void shm_comm_set_thresholds(shm_comm *c, size_t oneshot_max, size_t chunk_bytes);
/* Per-rank tuning, which the caller reads from the configuration registry
 * (collectives/config: COLLECTIVES_SHM_SPIN, _YIELD_US, _FAR_NS, _LLC_BYTES, _THP,
 * _CMA_ANY_CORES). A negative spin, yield_us or llc_bytes keeps the default chosen at
 * open, a far_ns of 0 or less the default round trip; none changes the protocol, so the
 * ranks may differ. Call it before the first collective. */
void shm_comm_set_tuning(shm_comm *c, long long spin, long long yield_us, long long far_ns,
                         long long llc_bytes, int thp, int cma_any_cores);
int shm_comm_error_peer(const shm_comm *c);    /* the peer of the last failure, or -1 */
uint32_t shm_comm_seq(const shm_comm *c);      /* steps completed so far */
size_t shm_comm_half_bytes(const shm_comm *c);
void shm_comm_abort(shm_comm *c);              /* make every later and current wait fail */
uint32_t shm_comm_coll(const shm_comm *c);     /* fingerprinted collectives started so far */
/* The recorded failure (SHM_FAIL_*; SHM_FAIL_NONE while there is none or it is being
 * written); text points into the segment. */
int shm_comm_fail_record(const shm_comm *c, uint32_t *k, int *a, int *b, uint64_t *wa,
                         uint64_t *wb, const char **text, uint32_t *number);
/* The caller's number of the next collective, and of those after it until the next call of
 * this (a hierarchical group's parts: several of them make one of its calls). A failure's
 * record carries its collective's number (0 where none was set). */
void shm_comm_number_next(shm_comm *c, uint32_t number);
/* Record a failure described by text (unless one is recorded already: returns 0 then)
 * and make every rank's waits on this group fail with SHM_EFAILED. */
int shm_comm_poison(shm_comm *c, const char *text);

/* Errors follow the TCP engine's convention: a call returns nonzero and the engine writes
 * the text that the extension's one _check raises (collectives/core/engine_errors.py expands
 * its placeholders: {rank:N} a rank by its name in the group, {failure} the recorded
 * failure, described from shm_comm_fail_record). */
#define SHM_ERR_TEXT 512
/* The text for code rc returned by `op` (peer < 0: the peer the engine last blamed);
 * label names the group. Waits up to a second for a failure record another rank is
 * writing; call it without the GIL. The text lives in c until the next call. */
/* What code rc means, in a few words. */
const char *shm_strerror(int rc);
/* number > 0: the failing collective's number in the group (named in the text), else none */
const char *shm_comm_error_text(shm_comm *c, int rc, const char *op, int peer,
                                const char *label, long number);

/* Collectives. fp is the caller's fingerprint of the call (collectives/core/fingerprint.py):
 * every rank compares every peer's with its own, before it copies or reduces a peer's
 * data into its buffer, and a difference fails the call on every rank (SHM_EFAILED). */

/* Collective: find out whether every rank can read the others' memory directly
 * (process_vm_readv); if so, all_gather/gather blocks of at least gather_min bytes,
 * where the ranks are at most two a core also broadcasts of at least bcast_min bytes, and
 * where they do not outnumber the cores also all_reduces of at least ar_min bytes (above
 * the one-shot size) (0: never) go in one copy instead of two. shm_cma_enabled says the
 * last (and is what the probe returns), shm_cma_readable the first. */
int shm_cma_probe(shm_comm *c);
int shm_cma_enabled(const shm_comm *c);
int shm_cma_readable(const shm_comm *c);
/* Whether this rank's writes into the segment stream past the caches (non-temporal
 * stores), so that ranks on far cores read them from memory instead of from this core's
 * cache: SHM_STREAM_OFF, SHM_STREAM_ON, or SHM_STREAM_AUTO (measured, see shm_copy.c). */
#define SHM_STREAM_OFF 0
#define SHM_STREAM_ON 1
#define SHM_STREAM_AUTO 2
void shm_comm_set_stream(shm_comm *c, int mode);
/* Whether this rank's segment writes stream now; what the probes last said of peer q
 * (0 not measured, 1 near, 2 far). */
int shm_comm_far(const shm_comm *c);
int shm_comm_peer_distance(const shm_comm *c, int q);
void shm_comm_set_cma_min(shm_comm *c, size_t gather_min, size_t bcast_min, size_t ar_min);
/* The all_reduce above the one-shot size: SHM_AR_AUTO measures two-shot with plain
 * stores, two-shot with streaming stores (as the stream mode allows) and the single copy
 * (where CMA is on and the size reaches ar_min) while it runs, and every rank takes the
 * arm that was fastest on the slowest rank (see shm_tune.c); SHM_AR_TWO_SHOT always
 * takes two-shot (stores by the stream mode), SHM_AR_SINGLE_COPY the single copy where
 * CMA is on (from ar_min). Every rank must pass the same. */
#define SHM_AR_AUTO 0
#define SHM_AR_TWO_SHOT 1
#define SHM_AR_SINGLE_COPY 2
void shm_comm_set_ar_algo(shm_comm *c, int algo);
/* What the size class of nbytes last agreed on, or -1 while it has not decided: for kind
 * 0 (all_reduce) 0 two-shot plain, 1 two-shot streaming, 2 single copy; for kind 1 (the
 * two-copy all_gather's stores, timed likewise with SHM_STREAM_AUTO) 0 plain, 1 streaming. */
int shm_comm_tune_choice(const shm_comm *c, int kind, size_t nbytes);

int shm_barrier(shm_comm *c, uint64_t fp);
int shm_broadcast(shm_comm *c, void *buf, size_t nbytes, int root, uint64_t fp);
int shm_all_reduce(shm_comm *c, void *buf, size_t count, int dtype, int op, uint64_t fp);
/* Buffers every rank maps, for the mapped all_reduce (shm_mapped.c). Register (collective:
 * every rank at the same call, which turns the mapped path's question on) this rank's
 * ``len`` bytes at ``lo`` as buffer ``id`` (the same id on every rank), with ``peer[q]``
 * where rank q's is mapped here (SHM_ESYS when the table is full); unregister it (it
 * stays dead). */
int shm_map_register(shm_comm *c, uint32_t id, const void *lo, size_t len, const uintptr_t *peer);
void shm_map_unregister(shm_comm *c, uint32_t id);
uint64_t shm_map_calls(const shm_comm *c);  /* all_reduces that took the mapped path */
int shm_reduce(shm_comm *c, void *buf, size_t count, int dtype, int op, int root, uint64_t fp);
int shm_all_gather(shm_comm *c, void *out, const void *in, size_t nbytes, uint64_t fp);
/* all_gather into n separate blocks of nbytes (outs[q] gets rank q's input) */
int shm_all_gather_list(shm_comm *c, void *const *outs, const void *in, size_t nbytes,
                        uint64_t fp);
int shm_gather(shm_comm *c, void *out, const void *in, size_t nbytes, int root, uint64_t fp);
int shm_scatter(shm_comm *c, void *out, const void *in, size_t nbytes, int root, uint64_t fp);
int shm_reduce_scatter(shm_comm *c, void *out, const void *in, size_t count, int dtype, int op,
                       uint64_t fp);
/* every rank also checks that what each peer sends it is what it expects (SHM_FAIL_COUNTS) */
int shm_all_to_all(shm_comm *c, void *out, const void *in, const size_t *out_bytes,
                   const size_t *in_bytes, uint64_t fp);

/* shm_barrier, shm_broadcast and shm_all_reduce begun with the caller's lock held (the GIL: releasing and
 * retaking it costs a small call more than its wait). Each does its call's work up to the
 * first wait that does not end within a short spin (an eighth of the waits' spin, about
 * 250 ns; none with more ranks than cores) and returns SHM_OK or an error once the call is
 * over, or SHM_PENDING with the rest left to shm_finish, which the caller must call next,
 * with the lock released, and which waits as the calls above do. Larger calls (a
 * broadcast above 48 bytes, an all_reduce of 4 KiB or more) are left whole to
 * shm_finish. They never touch Python either. */
#define SHM_PENDING 1
int shm_barrier_try(shm_comm *c, uint64_t fp);
int shm_broadcast_try(shm_comm *c, void *buf, size_t nbytes, int root, uint64_t fp);
int shm_all_reduce_try(shm_comm *c, void *buf, size_t count, int dtype, int op, uint64_t fp);
int shm_finish(shm_comm *c);

/* Point to point: a byte stream per ordered pair. */
/* Write hdr then buf to dst's ring; returns 1 if written, 0 if it did not fit (nothing written). */
int shm_p2p_try_send(shm_comm *c, int dst, const void *hdr, size_t hdr_len, const void *buf,
                     size_t nbytes);
/* Write hdr then buf, waiting for room as needed. */
int shm_p2p_send(shm_comm *c, int dst, const void *hdr, size_t hdr_len, const void *buf,
                 size_t nbytes);
/* Wait up to wait_s for a source with at least `need` readable bytes; returns it, or -1.
 * It only looks: the caller reads the message (one reader at a time, its lock).
 * background=1: the background receiver's poll; it sleeps without spinning, and without
 * looking while any of the process's threads reads the rings for a receive it waits on
 * (shm_p2p_direct). background=0: such a thread's poll; it also returns -1 once
 * shm_p2p_kick has been called since `since` (shm_p2p_kicks, read before the caller last
 * saw its request unfinished): another thread may have completed the request. */
int shm_p2p_poll(shm_comm *c, size_t need, double wait_s, int background, uint32_t since,
                 int *src);
uint32_t shm_p2p_kicks(const shm_comm *c);
/* delta +1: a thread starts reading the rings for a receive it waits on (so a message
 * wakes it, not the background receiver and then it); -1: it stops, and with `wake`
 * wakes the background receiver if no other thread is reading them. */
void shm_p2p_direct(shm_comm *c, int delta, int wake);
/* Read exactly nbytes from src's stream (buf NULL discards), waiting as needed. */
int shm_p2p_read(shm_comm *c, int src, void *buf, size_t nbytes);
/* wake this rank's own p2p waiters (a receive completed for another thread; shutdown) */
void shm_p2p_kick(shm_comm *c);
/* Register the point-to-point layer's kick as what shm_comm_abort runs after it marks
 * the communicator aborted (the segment layer never calls up into p2p itself). */
void shm_p2p_attach(shm_comm *c);

#endif
