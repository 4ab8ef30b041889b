/* The shared segment: mapping, waits (spin, yield, futex, dead peers), the steps'
 * counters, the group's failure record and the fingerprint checks; see shm_sync.h. */
#include "shm_sync.h"

/* 1 if pid is a live process (not a zombie). */
static int pid_alive(int pid)
{
    if (pid <= 0)
        return 1; /* not mapped yet: only the timeout can tell */
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 0;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? 0 : 1;
    ssize_t k = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (k <= 0)
        return 1;
    buf[k] = 0;
    char *p = strrchr(buf, ')');
    if (p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X'))
        return 0;
    return 1;
}

/* Whether peer q last waited on the CPU this rank runs on now (kept up to date for the
 * peers' same question). Two ranks of a busy machine often end up on one CPU (a futex
 * wake-up pulls the woken rank to the waker's), and there a spin only delays the peer. */
static int same_cpu(shm_comm *c, int q)
{
    int32_t cpu = (int32_t)sched_getcpu() + 1;
    if (cpu <= 0)
        return 0;
    if (atomic_load_explicit(&c->ctl[c->me].info.cpu, memory_order_relaxed) != cpu)
        atomic_store_explicit(&c->ctl[c->me].info.cpu, cpu, memory_order_relaxed);
    return atomic_load_explicit(&c->ctl[q].info.cpu, memory_order_relaxed) == cpu;
}

SHM_HIDDEN int wait_ctr_slow(shm_comm *c, ctr_t *ctr, uint32_t target, int peer,
                             int64_t deadline_ns)
{
    int spin = c->spin && peer >= 0 && peer != c->me && same_cpu(c, peer) ? 0 : c->spin;
    for (int i = 0; i < spin; i++) {
        cpu_relax();
        if (ge(atomic_load_explicit(&ctr->v, memory_order_acquire), target))
            return SHM_OK;
    }
    int64_t t = now_ns();
    if (deadline_ns < 0)
        deadline_ns = t + c->timeout_ns;
    int64_t next_check = t + 20000000LL;
    int64_t yield_until = t + c->yield_ns;
    for (;;) {
        if (atomic_load_explicit(&c->aborted, memory_order_relaxed))
            return SHM_ECLOSED;
        if (atomic_load_explicit(&seg_hdr(c)->fail_state, memory_order_relaxed))
            return SHM_EFAILED;  /* another rank recorded the group's failure */
        if (t < yield_until) {
            sched_yield();
        } else {
            atomic_fetch_add_explicit(&ctr->waiters, 1, memory_order_seq_cst);
            uint32_t v = atomic_load_explicit(&ctr->v, memory_order_seq_cst);
            if (!ge(v, target))
                futex_wait(&ctr->v, v, 10000000LL);
            atomic_fetch_sub_explicit(&ctr->waiters, 1, memory_order_seq_cst);
        }
        if (ge(atomic_load_explicit(&ctr->v, memory_order_acquire), target))
            return SHM_OK;
        t = now_ns();
        if (t >= next_check) {
            next_check = t + 50000000LL;
            if (peer >= 0 && !pid_alive(atomic_load(&c->ctl[peer].info.pid))) {
                c->err_peer = peer;
                return SHM_EPEERDEAD;
            }
        }
        if (t >= deadline_ns) {
            c->err_peer = peer;
            return SHM_ETIMEDOUT;
        }
    }
}

/* ---- segment ------------------------------------------------------------- */

static void layout(int n, size_t half, size_t ring, size_t *ctl_off, size_t *slot_off,
                   size_t *rctl_off, size_t *rdata_off, size_t *total)
{
    *ctl_off = PAGE;
    *slot_off = round_up(*ctl_off + (size_t)n * sizeof(rank_ctl_t), PAGE);
    *rctl_off = *slot_off + (size_t)n * 2 * half;
    *rdata_off = round_up(*rctl_off + (size_t)n * n * sizeof(ring_ctl_t), PAGE);
    *total = *rdata_off + (size_t)n * n * ring;
}

/* Size of the largest cache of cpu0, from sysfs (glibc's sysconf can be ten times off
 * under a hypervisor, where sysfs and lscpu agree); 8 MiB when unknown. */
static size_t llc_bytes(void)
{
    size_t best = 0;
    int best_level = 0;
    for (int i = 0; i < 8; i++) {
        char path[96], buf[32];
        int level = 0;
        unsigned long long v = 0;
        char unit = 0;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        FILE *f = fopen(path, "r");
        if (!f)
            break;
        if (fscanf(f, "%d", &level) != 1)
            level = 0;
        fclose(f);
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        if (!(f = fopen(path, "r")))
            continue;
        int got = fgets(buf, sizeof buf, f) != NULL && sscanf(buf, "%llu%c", &v, &unit) >= 1;
        fclose(f);
        if (!got)
            continue;
        v <<= unit == 'K' ? 10 : unit == 'M' ? 20 : unit == 'G' ? 30 : 0;
        if (level > best_level || (level == best_level && v > best)) {
            best_level = level;
            best = (size_t)v;
        }
    }
    return best ? best : (size_t)8 << 20;
}

int shm_comm_open(shm_comm **out, const char *name, int create, int rank, int size,
                  size_t half_bytes, size_t ring_bytes, double timeout_s, int *sys_errno)
{
    *out = NULL;
    *sys_errno = 0;
    if (size < 1 || rank < 0 || rank >= size || half_bytes < PAGE ||
        half_bytes < CL + (size_t)size * 128)
        return SHM_EINVAL;
    if (ring_bytes & (ring_bytes - 1) || ring_bytes < 4096)
        return SHM_EINVAL;
    half_bytes = round_up(half_bytes, PAGE);
    size_t ctl_off, slot_off, rctl_off, rdata_off, total;
    layout(size, half_bytes, ring_bytes, &ctl_off, &slot_off, &rctl_off, &rdata_off, &total);
    int fd = shm_open(name, create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
    if (fd < 0) {
        *sys_errno = errno;
        return SHM_ESYS;
    }
    /* The creator holds a shared lock on the segment while its process lives (the lock
     * goes with the process, however it ends): a segment whose name is still linked but
     * that nobody locks was left by a creator killed before it could unlink the name, and
     * a later creator sweeps it away (backends/shm.py). */
    if (create && (flock(fd, LOCK_SH | LOCK_NB) != 0 || ftruncate(fd, (off_t)total) != 0)) {
        *sys_errno = errno;
        close(fd);
        shm_unlink(name);
        return SHM_ESYS;
    }
    if (!create) {
        struct stat st;
        if (fstat(fd, &st) != 0 || (size_t)st.st_size != total) {
            close(fd);
            return SHM_EINVAL;
        }
    }
    void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    *sys_errno = errno;
    if (p == MAP_FAILED || !create)
        close(fd);
    if (p == MAP_FAILED) {
        if (create)
            shm_unlink(name);
        return SHM_ESYS;
    }
    seg_hdr_t *h = (seg_hdr_t *)p;
    if (create) {
        h->size = (uint64_t)size;
        h->half_bytes = half_bytes;
        h->ring_bytes = ring_bytes;
        h->total = total;
        atomic_thread_fence(memory_order_release);
        h->magic = SHM_MAGIC;
    } else if (h->magic != SHM_MAGIC || h->size != (uint64_t)size || h->half_bytes != half_bytes ||
               h->ring_bytes != ring_bytes || h->total != total) {
        munmap(p, total);
        return SHM_EINVAL;
    }
    shm_comm *c = calloc(1, sizeof *c);
    if (!c) {
        munmap(p, total);
        if (create)
            close(fd);
        return SHM_ESYS;
    }
    c->lock_fd = create ? fd : -1;
    c->base = p;
    c->total = total;
    c->n = size;
    c->me = rank;
    c->half = half_bytes;
    c->ring = ring_bytes;
    c->chunk = half_bytes;
    c->oneshot_max = half_bytes;
    c->ctl = (rank_ctl_t *)(c->base + ctl_off);
    c->slots = c->base + slot_off;
    c->rctl = (ring_ctl_t *)(c->base + rctl_off);
    c->rdata = c->base + rdata_off;
    c->err_peer = -1;
    if (!(c->dist = calloc((size_t)size, 1))
        || !(c->seen = calloc((size_t)size * 2, sizeof *c->seen))) {
        munmap(p, total);
        if (create)
            close(fd);
        free(c->dist);
        free(c);
        return SHM_ESYS;
    }
    c->llc = llc_bytes();
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    if (ncpu < 1)
        ncpu = 1;
    /* spin ~2 us, then yield: even when every rank has a core, the scheduler now and
     * then puts two ranks on one core for a while, and a longer spin then burns the
     * time slice the awaited rank needs (measured: 64 KiB broadcast, two ranks pinned
     * to one core, 57.6 us per call with a 50 us spin, 8.0 us with 2 us; unchanged
     * 8.1 us on two cores). pause costs 10-150 ns depending on CPU and load.
     * With more ranks than cores no spin at all: some rank always waits for a core, and
     * every poll keeps it off (measured, 2 cores, per call, no spin vs 2 us: 4 ranks
     * broadcast 4 B 3.6 vs 5.7 us, barrier 4.7 vs 5.8, all_gather 4 B 4.9 vs 7.0;
     * 3 ranks all_reduce 16 KiB 9.2 vs 27.1, all_gather 256 KiB 80 vs 297; 8 ranks
     * barrier 13.4 vs 19.6). */
    int64_t t0 = now_ns();
    for (int i = 0; i < 1000; i++)
        cpu_relax();
    int64_t per = (now_ns() - t0) / 1000;
    if (per < 1)
        per = 1;
    c->spin = size <= ncpu ? (int)(2000 / per) : 0;
    c->shared_verdict = size > ncpu;
    /* then yield (a busy machine deschedules the peer for a while; sleeping right
     * away would cost a scheduler wake-up per step), then sleep on the futex */
    c->yield_ns = size <= ncpu ? 200000 : 20000;
    c->far_ns = PROBE_FAR_NS;
    c->thp = 1;
    shm_comm_set_timeout(c, timeout_s);
    atomic_store(&c->ctl[rank].info.pid, (int32_t)getpid());
    *out = c;
    return SHM_OK;
}

void shm_comm_close(shm_comm *c)
{
    if (!c)
        return;
    munmap(c->base, c->total);
    if (c->lock_fd >= 0)
        close(c->lock_fd);
    free(c->cma_tmp);
    for (int i = 0; i < c->n_mapped; i++)
        free(c->mapped[i].peer);
    free(c->dist);
    free(c->seen);
    free(c);
}

int shm_comm_unlink(const char *name) { return shm_unlink(name) == 0 ? SHM_OK : SHM_ESYS; }

void shm_comm_set_timeout(shm_comm *c, double timeout_s)
{
    if (timeout_s <= 0 || timeout_s > 1e8)
        timeout_s = 1e8;
    c->timeout_ns = (int64_t)(timeout_s * 1e9);
}

void shm_comm_set_thresholds(shm_comm *c, size_t oneshot_max, size_t chunk_bytes)
{
    c->oneshot_max = oneshot_max < c->half ? oneshot_max : c->half;
    if (chunk_bytes < 4096)
        chunk_bytes = 4096;
    c->chunk = chunk_bytes < c->half ? chunk_bytes : c->half;
}

void shm_comm_set_tuning(shm_comm *c, long long spin, long long yield_us, long long far_ns,
                         long long llc_bytes, int thp, int cma_any_cores)
{
    if (spin >= 0)
        c->spin = spin < INT_MAX ? (int)spin : INT_MAX;
    if (yield_us >= 0)
        c->yield_ns = yield_us < INT64_MAX / 1000 ? (int64_t)yield_us * 1000 : INT64_MAX;
    c->far_ns = far_ns > 0 ? (int64_t)far_ns : PROBE_FAR_NS;  /* 0 or less: the default */
    if (llc_bytes >= 0)
        c->llc = (size_t)llc_bytes;
    c->thp = thp != 0;
    c->cma_any_cores = cma_any_cores != 0;
}

int shm_comm_error_peer(const shm_comm *c) { return c->err_peer; }
uint32_t shm_comm_seq(const shm_comm *c) { return c->seq; }
size_t shm_comm_half_bytes(const shm_comm *c) { return c->half; }

void shm_comm_abort(shm_comm *c)
{
    atomic_store(&c->aborted, 1);
    if (c->abort_hook)  /* p2p's waiting threads (shm_p2p_attach) */
        c->abort_hook(c);
}

uint32_t shm_comm_coll(const shm_comm *c) { return c->coll; }

const char *shm_strerror(int rc)
{
    switch (rc) {
    case SHM_ETIMEDOUT: return "Timed out waiting";  /* torch gloo's words, which torch's tests match */
    case SHM_EPEERDEAD: return "lost (process died)";
    case SHM_EBROKEN: return "group unusable after an earlier failure";
    case SHM_EINVAL: return "segment layout mismatch or bad argument";
    case SHM_ECLOSED: return "communicator shut down";
    case SHM_ESYS: return "a system call or an allocation failed";
    case SHM_EFAILED: return "the group failed";
    case -1: return "unknown dtype";
    case -2: return "op not defined for dtype";
    default: return "error";
    }
}

const char *shm_comm_error_text(shm_comm *c, int rc, const char *op, int peer,
                                const char *label, long number)
{
    char *e = c->errbuf;
    const size_t n = sizeof c->errbuf;
    if (peer < 0)
        peer = c->err_peer;
    if (rc == SHM_EFAILED || rc == SHM_EBROKEN) {
        const seg_hdr_t *h = seg_hdr(c);
        uint32_t st = SHM_FAIL_NONE;
        for (int i = 0; i < 1000; i++) {  /* a record being written is there within ~1 s */
            st = atomic_load_explicit(&h->fail_state, memory_order_acquire);
            if (st != FAIL_WRITING)
                break;
            struct timespec ms = {0, 1000000};
            nanosleep(&ms, NULL);
        }
        if (st != SHM_FAIL_NONE && st != FAIL_WRITING) {
            /* the call at which this rank learns of it raises the record itself (a rank may
             * learn it at entry, when others failed the call before it arrived) */
            if (!c->reported) {
                c->reported = 1;
                snprintf(e, n, "{failure}");
            } else {
                snprintf(e, n, "%s %s: group unusable after an earlier failure: {failure}",
                         label, op);
            }
            return e;
        }
    }
    char who[48], msg[160];
    if (peer >= 0)
        snprintf(who, sizeof who, "peer rank {rank:%d}", peer);
    else
        snprintf(who, sizeof who, "peers");
    if (rc == SHM_ETIMEDOUT)
        snprintf(msg, sizeof msg, "%s %.0fms for %s", shm_strerror(rc), c->timeout_ns / 1e6, who);
    else if (rc == SHM_EPEERDEAD)
        snprintf(msg, sizeof msg, "%s %s", who, shm_strerror(rc));
    else if (rc == -1 || rc == -2 || (rc <= SHM_ETIMEDOUT && rc >= SHM_EFAILED))
        snprintf(msg, sizeof msg, "%s", shm_strerror(rc));
    else
        snprintf(msg, sizeof msg, "error %d", rc);
    if (number > 0)  /* the collective's number, as the user counts calls (mismatch errors too) */
        snprintf(e, n, "%s %s (collective #%ld) failed on rank {rank:%d}: %s", label, op, number,
                 c->me, msg);
    else
        snprintf(e, n, "%s %s failed on rank {rank:%d}: %s", label, op, c->me, msg);
    return e;
}

int shm_comm_fail_record(const shm_comm *c, uint32_t *k, int *a, int *b, uint64_t *wa,
                         uint64_t *wb, const char **text, uint32_t *number)
{
    const seg_hdr_t *h = seg_hdr(c);
    uint32_t st = atomic_load_explicit(&h->fail_state, memory_order_acquire);
    if (st == FAIL_WRITING)
        return SHM_FAIL_NONE;
    *k = h->fail_k;
    *a = h->fail_a;
    *b = h->fail_b;
    *wa = h->fail_wa;
    *wb = h->fail_wb;
    *text = h->fail_text;
    *number = h->fail_number;
    return (int)st;
}

void shm_comm_number_next(shm_comm *c, uint32_t number)
{
    unsigned i = (c->marks_n + SEQ_MARKS - 1) % SEQ_MARKS;
    if (!c->marks_n || c->marks[i].first != c->coll + 1)  /* else a second call replaces */
        i = c->marks_n++ % SEQ_MARKS;
    c->marks[i].first = c->coll + 1;
    c->marks[i].number = number;
}

/* The caller's number of collective k, which this rank has begun: that of its latest mark
 * at or before k; 0 where the marks kept do not reach back to k. */
static uint32_t number_of(const shm_comm *c, uint32_t k)
{
    uint32_t number = 0, first = 0;
    for (unsigned j = 0; j < SEQ_MARKS && j < c->marks_n; j++)
        if ((int32_t)(k - c->marks[j].first) >= 0
            && (!number || (int32_t)(c->marks[j].first - first) > 0)) {
            first = c->marks[j].first;
            number = c->marks[j].number;
        }
    return number;
}

int shm_comm_poison(shm_comm *c, const char *text)
{
    return record_fail(c, SHM_FAIL_TEXT_SET, c->coll, c->me, -1, 0, 0, text);
}

/* ---- steps ----------------------------------------------------------------- */

/* Next block's half of my slot, once every rank has read what it last held. */
SHM_HIDDEN int half_acquire(shm_comm *c, int *h)
{
    *h = (int)(c->blk++ & 1);
    uint32_t need = c->free_after[*h];
    for (int q = 0; q < c->n; q++)
        if (q != c->me) {
            int rc = wait_ctr(c, &c->ctl[q].ack, need, q, -1);
            if (rc)
                return rc;
        }
    return SHM_OK;
}

SHM_HIDDEN int wait_posts(shm_comm *c, uint32_t s)
{
    for (int q = 0; q < c->n; q++)
        if (q != c->me) {
            int rc = wait_post(c, q, s);
            if (rc)
                return rc;
        }
    return SHM_OK;
}

/* ---- the failure record and fingerprint checks (see shm_sync.h) ---------- */

static void wake_all(shm_comm *c)
{
    for (int q = 0; q < c->n; q++) {
        ctr_t *cs[3] = {&c->ctl[q].post, &c->ctl[q].ack, &c->ctl[q].bell};
        for (int i = 0; i < 3; i++)
            if (atomic_load_explicit(&cs[i]->waiters, memory_order_seq_cst))
                futex_wake(&cs[i]->v);
    }
}

/* Record the group's failure (first writer wins), break it and wake every waiter. */
SHM_HIDDEN int record_fail(shm_comm *c, uint32_t state, uint32_t k, int a, int b, uint64_t wa,
                           uint64_t wb, const char *text)
{
    seg_hdr_t *h = seg_hdr(c);
    uint32_t none = 0;
    int first = atomic_compare_exchange_strong(&h->fail_state, &none, FAIL_WRITING);
    if (first) {
        h->fail_k = k;
        h->fail_number = number_of(c, k);
        h->fail_a = a;
        h->fail_b = b;
        h->fail_wa = wa;
        h->fail_wb = wb;
        h->fail_text[0] = 0;
        if (text) {
            strncpy(h->fail_text, text, SHM_FAIL_TEXT - 1);
            h->fail_text[SHM_FAIL_TEXT - 1] = 0;
        }
        atomic_store_explicit(&h->fail_state, state, memory_order_release);
    }
    atomic_store(&c->broken, 1);
    wake_all(c);
    return first;
}

/* Wait for every peer's post of step s (this collective's first) and compare. */
SHM_HIDDEN int fp_check_all(shm_comm *c, uint32_t s)
{
    for (int q = 0; q < c->n; q++)
        if (q != c->me) {
            int rc = wait_post(c, q, s);
            if (!rc)
                rc = fp_check(c, q);
            if (rc)
                return rc;
        }
    c->ahead = 0;  /* every peer has started this collective: it is past the earlier ones */
    for (int i = 0; c->bc_n_due && i < BC_RING; i++)
        if (c->bc_due[i].due) {
            int rc = bc_settle(c, i);
            if (rc)
                return rc;
        }
    return c->n_due ? fp_settle(c, s) : SHM_OK;
}

SHM_HIDDEN int bc_settle(shm_comm *c, int i)
{
    uint64_t w;
    for (int q = 0; q < c->n; q++)
        if (q != c->me) {
            int rc = wait_seen(c, q, 0, c->bc_due[i].s);  /* q has arrived there */
            /* a reader's word is in its ring record: found there, q's post line (which
             * fp_find reads first) is not read */
            if (!rc && !(rec_find(&c->ctl[q].bc[c->bc_due[i].s % BC_RING], c->bc_due[i].k, &w)
                         && w == c->bc_due[i].word))
                /* a reader that has moved on compared the root's record at the call */
                rc = fp_check_word(c, q, c->bc_due[i].k, c->bc_due[i].s, c->bc_due[i].word, 1);
            if (rc)
                return rc;
        }
    c->bc_due[i].due = 0;
    c->bc_n_due--;
    return SHM_OK;
}

SHM_HIDDEN int fp_catch_up(shm_comm *c, uint32_t k)
{
    /* q has started collective k - 3, so it has compared k - 4, whose slot k reuses */
    int rc = wait_posts(c, c->s0_of[(k + 1) % FP_SLOTS]);
    if (rc)
        return rc;
    /* once every peer is past the last small broadcast, the other collectives bound the
     * run-ahead themselves (a one-block broadcast's root by its halves' acks) */
    for (int q = 0; q < c->n; q++)
        if (q != c->me && !ge(atomic_load_explicit(&c->ctl[q].ack.v, memory_order_acquire),
                              c->bc_last))
            return SHM_OK;
    c->ahead = 0;
    return SHM_OK;
}

SHM_HIDDEN int fp_settle(shm_comm *c, uint32_t s)
{
    int kept = 0;
    for (int i = 0; i < c->n_due; i++) {
        if (!ge(s, c->fp_due[i].s0)) {  /* not yet known to have arrived: keep it due */
            c->fp_due[kept++] = c->fp_due[i];
            continue;
        }
        for (int q = 0; q < c->n; q++)
            if (q != c->me) {
                /* q acked or posted a later step: the wait returns at once */
                int rc = wait_post(c, q, c->fp_due[i].s0);
                /* q may have moved four collectives on since (as the root of broadcasts
                 * of its own) and reused the slot: then it is no longer known what q
                 * called there, and the readers of that broadcast compared at the call */
                if (!rc)
                    rc = fp_check_word(c, q, c->fp_due[i].k, c->fp_due[i].s0, c->fp_due[i].word, 1);
                if (rc)
                    return rc;
            }
    }
    c->n_due = kept;
    return SHM_OK;
}

SHM_HIDDEN int fp_defer(shm_comm *c, uint32_t s0)
{
    if (c->n_due == 2) {  /* keep the run-ahead short: settle the oldest, waiting for it */
        int rc = fp_settle(c, c->fp_due[0].s0);
        if (rc)
            return rc;
    }
    c->fp_due[c->n_due].k = c->coll;
    c->fp_due[c->n_due].s0 = s0;
    c->fp_due[c->n_due].word = c->fp;
    c->n_due++;
    return SHM_OK;
}

/* A collective with no data on this rank (zero bytes): one step to compare fingerprints. */
SHM_HIDDEN int fp_sync(shm_comm *c, uint64_t word)
{
    int rc = fp_publish(c, word);
    if (rc)
        return fail(c, rc);
    uint32_t s = ++c->seq;
    post(c, s);
    return fail(c, fp_check_all(c, s));
}
