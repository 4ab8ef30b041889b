/* The measured choices (see shm_tune.h): the all_reduce above the one-shot size, and the
 * all_gather's path and, from the single copy's threshold, its form (the same scheme, a
 * table of its own).
 *
 * Which all_reduce is fastest above the one-shot size depends on the host and on where
 * the ranks run, not on one latency figure (the figures: docs/design-shm.md, "The measured
 * all_reduce choice"). So the ranks time the candidates on the calls they are making and
 * keep the fastest:
 *
 * - Per size class (a power of two from 64 KiB), the k candidate algorithms (two-shot
 *   with plain stores, two-shot with streaming stores, the single copy: those that the
 *   settings and the host allow) are each run TUNE_TRIALS times in a row in a round of
 *   trials (a call's time includes waiting for peers still busy with the call before,
 *   so an arm's later trials follow the same arm); each rank keeps its fastest time of
 *   each.
 * - The call after the round publishes those times in the rank's control block (before
 *   its first post), and at the class's next call every rank reads every rank's: it has
 *   seen each peer's first post of the publishing call, so the times are visible, and no
 *   peer publishes again before this rank has read them (no rank is more than one
 *   collective ahead). Each arm counts as its slowest rank's time, and every rank takes
 *   the fastest arm: the same data, the same choice, without a message.
 * - The next round follows TUNE_MIN_GAP calls later, twice as many while the choice
 *   holds (at most TUNE_MAX_GAP, and at most about TUNE_PERIOD_NS of the class's calls,
 *   so that a host that moves the ranks apart is followed within about a second).
 * The round's trials of slower arms are its cost: 3 arms, 3 trials, at most one round in
 * TUNE_MIN_GAP + 9 calls, a few percent at first and less as the gap doubles.
 * - That is a few percent only while the arms are close. Where the progress thread shares
 *   the cores with compute (DDP's buckets in the backward pass on a 2-core host), two-shot's
 *   ~130 synchronisations of a 32 MiB all_reduce each wait for a scheduler slice, and it
 *   measured 10-50x the single copy's time (400-880 ms against 11-15 ms): every round
 *   then cost seconds. So an arm whose time is TUNE_BENCH_RATIO times the winner's or
 *   more sits out the rounds of the next TUNE_BENCH_NS of the class's calls, or more
 *   where it lost by more (its next trials cost at most ~2% of the calls meanwhile; at
 *   least TUNE_BENCH_MIN calls): the rounds between time the close arms only (one arm
 *   left: its trials cost nothing), and the far loser is timed again after that.
 *   Every rank benches the same arms: the decision reads the same published times. */
#include "shm_tune.h"

#define TUNE_TRIALS 3         /* back to back: the later ones run as that arm runs in a loop */
#define TUNE_FIRST 2          /* the first calls pay for page faults: not timed */
#define TUNE_MIN_GAP 16
#define TUNE_MAX_GAP 4096
#define TUNE_PERIOD_NS 1000000000LL
#define TUNE_NONE INT64_MAX
#define TUNE_BENCH_RATIO 2
#define TUNE_BENCH_MIN 64
#define TUNE_BENCH_NS 10000000000LL
#define TUNE_BENCH_COST (TUNE_TRIALS * 50)  /* calls benched per unit of the time ratio */

/* log2 of each kind's smallest class's upper bound: all_reduce from 64 KiB (its one-shot
 * size), all_gather blocks from 4 KiB (below, streaming does not start) */
static const int BUCKET_MIN[TUNE_KINDS] = {16, 12};

static int bucket_of(int kind, size_t nbytes)
{
    int b = 0;
    while (b < TUNE_BUCKETS - 1 && (nbytes >> (BUCKET_MIN[kind] + b + 1)))
        b++;
    return b;
}

/* The two-shot arm that the stream mode (and, in SHM_STREAM_AUTO, the probes) choose. */
static int two_shot_arm(const shm_comm *c)
{
    return c->far ? ARM_TWO_STREAM : ARM_TWO_PLAIN;
}

static int single_copy_allowed(const shm_comm *c, size_t nbytes)
{
    return c->cma && c->cma_ar_min && nbytes >= c->cma_ar_min;
}

/* The stores the stream mode allows, in ARM_* order. */
static int store_arms(const shm_comm *c, int *arms)
{
    int k = 0;
    if (c->stream_mode != SHM_STREAM_ON)
        arms[k++] = ARM_TWO_PLAIN;
    if (c->stream_mode != SHM_STREAM_OFF)
        arms[k++] = ARM_TWO_STREAM;
    return k;
}

static void decide(shm_comm *c, int kind, int b, tune_t *t, uint32_t i)
{
    int64_t slowest[TUNE_ARMS];
    int best = -1;
    for (int a = 0; a < TUNE_ARMS; a++) {
        int64_t worst = 0;
        for (int r = 0; r < c->n; r++) {
            int64_t v = atomic_load_explicit(&c->ctl[r].tune[kind][b][a], memory_order_relaxed);
            if (v <= 0 || v == TUNE_NONE) {  /* never published (0), or not timed */
                worst = TUNE_NONE;
                break;
            }
            if (v > worst)
                worst = v;
        }
        slowest[a] = worst;
        if (slowest[a] != TUNE_NONE && (best < 0 || slowest[a] < slowest[best]))
            best = a;
    }
    t->decide_at = 0;
    if (best < 0) {  /* nothing measured on some rank: try again later */
        t->trial_at = i + TUNE_MIN_GAP;
        return;
    }
    for (int a = 0; a < TUNE_ARMS; a++) {
        if (slowest[a] == TUNE_NONE || slowest[a] / TUNE_BENCH_RATIO < slowest[best])
            continue;
        /* its next trials cost at most ~2% of the winner's time meanwhile */
        int64_t bench = TUNE_BENCH_NS / slowest[best];
        int64_t by_cost = TUNE_BENCH_COST * (slowest[a] / slowest[best]);
        if (bench < by_cost)
            bench = by_cost;
        if (bench < TUNE_BENCH_MIN)
            bench = TUNE_BENCH_MIN;
        if (bench > (1 << 24))
            bench = 1 << 24;
        t->benched[a] = (i + (uint32_t)bench) | 1;  /* (never 0: 0 means not benched) */
    }
    if (best == t->arm)
        t->gap = t->gap * 2 < TUNE_MAX_GAP ? t->gap * 2 : TUNE_MAX_GAP;
    else
        t->gap = TUNE_MIN_GAP;
    int64_t by_time = TUNE_PERIOD_NS / slowest[best];
    if (by_time < TUNE_MIN_GAP)
        by_time = TUNE_MIN_GAP;
    if ((int64_t)t->gap > by_time)
        t->gap = (uint32_t)by_time;
    t->arm = best;
    t->trial_at = i + t->gap;
}

/* Whether `arm` is among the k `arms` that a call's settings and size allow. */
static int allowed(int arm, const int *arms, int k)
{
    for (int a = 0; a < k; a++)
        if (arms[a] == arm)
            return 1;
    return 0;
}

/* The arm for this call of the class: a trial, the agreed choice, or `fallback` before
 * the first decision (or where the agreed arm is not among `arms` for this size). */
static int choose(shm_comm *c, int kind, size_t nbytes, const int *arms, int k, int fallback,
                  int64_t *t0)
{
    int b = bucket_of(kind, nbytes);
    tune_t *t = &c->tune[kind][b];
    if (!t->gap) {  /* the class's first call (the comm starts zeroed) */
        t->trial_at = TUNE_FIRST;
        t->gap = TUNE_MIN_GAP;
        t->arm = TUNE_ARMS;
    }
    uint32_t i = t->calls++;
    if (t->decide_at && i == t->decide_at)
        decide(c, kind, b, t, i);
    if (i == t->trial_at) {  /* a round starts: the benched arms sit it out */
        int kept = 0;
        for (int a = 0; a < k; a++) {
            uint32_t until = t->benched[arms[a]];
            if (until && (int32_t)(until - i) > 0)
                continue;
            t->benched[arms[a]] = 0;
            t->round[kept++] = arms[a];
        }
        t->round_k = kept;
        for (int a = 0; a < TUNE_ARMS; a++)
            t->best[a] = TUNE_NONE;
    }
    uint32_t n_trials = (uint32_t)(TUNE_TRIALS * t->round_k);
    if (i - t->trial_at < n_trials) {  /* a trial of this round */
        int arm = t->round[(i - t->trial_at) / TUNE_TRIALS];
        if (allowed(arm, arms, k)) {  /* (else this call's size rules it out: not timed) */
            *t0 = now_ns();
            return arm;
        }
        return allowed(t->arm, arms, k) ? t->arm : fallback;
    }
    if (i - t->trial_at == n_trials) {  /* publish before this call's first post */
        for (int a = 0; a < TUNE_ARMS; a++)
            atomic_store_explicit(&c->ctl[c->me].tune[kind][b][a], t->best[a],
                                  memory_order_relaxed);
        t->decide_at = i + 1;
        t->trial_at = i - n_trials - 1;  /* no trials until decide() sets the next round */
    }
    return allowed(t->arm, arms, k) ? t->arm : fallback;
}

SHM_HIDDEN int tune_pick(shm_comm *c, size_t nbytes, int64_t *t0)
{
    *t0 = 0;
    if (c->ar_algo == SHM_AR_SINGLE_COPY && single_copy_allowed(c, nbytes))
        return ARM_SINGLE_COPY;
    if (c->ar_algo != SHM_AR_AUTO)
        return two_shot_arm(c);
    int arms[TUNE_ARMS];
    int k = store_arms(c, arms);
    if (single_copy_allowed(c, nbytes))
        arms[k++] = ARM_SINGLE_COPY;
    if (k < 2)
        return two_shot_arm(c);
    return choose(c, TUNE_ALL_REDUCE, nbytes, arms, k, two_shot_arm(c), t0);
}

/* From the single copy's own threshold (COLLECTIVES_SHM_CMA_MIN) where every rank has a
 * core, the all_gather always takes the single copy, and times its two forms: each block
 * written in pieces (each piece to every reader while it is in cache) or in one write
 * (fewer system calls and page pins; 2 ranks on a host of 2026-11-30: 1 MiB 0.9x, 4 MiB
 * 0.7x the time in pieces, where an earlier host measured the opposite at 4 MiB). Below
 * that threshold, and at every size where the ranks outnumber the
 * cores, the all_gather is timed as the all_reduce is: the two-copy path with the stores
 * the stream mode allows (both with SHM_STREAM_AUTO: the probes' verdict misleads on some
 * hosts, every pair "far" and streaming slower) and, from GATHER_CMA_TRY bytes a block,
 * the single copy, which can win from small blocks (Open MPI reads 64 KiB blocks in one
 * copy), also where the ranks outnumber the cores (figures: docs/design-shm.md, "Measured
 * figures behind the engine's constants"). */
#define GATHER_CMA_TRY (16 * 1024)
SHM_HIDDEN int tune_pick_gather(shm_comm *c, size_t nbytes, int cma_only, size_t piece,
                                int64_t *t0)
{
    *t0 = 0;
    int arms[TUNE_ARMS];
    int k = 0;
    if (!cma_only) {
        if (nbytes < PROBE_SMALL_MIN)
            return two_shot_arm(c);
        k = store_arms(c, arms);
        if (c->stream_mode != SHM_STREAM_AUTO)
            k = 1, arms[0] = two_shot_arm(c);
    }
    int fallback = cma_only ? ARM_SINGLE_COPY : two_shot_arm(c);
    if (cma_only || (c->cma_readable && c->cma_min && nbytes >= GATHER_CMA_TRY)) {
        arms[k++] = ARM_SINGLE_COPY;
        /* the block in one write against in pieces: which is faster varies by host */
        if (nbytes > piece)
            arms[k++] = ARM_SINGLE_WHOLE;
    }
    if (k < 2)
        return fallback;
    return choose(c, TUNE_ALL_GATHER, nbytes, arms, k, fallback, t0);
}

SHM_HIDDEN void tune_done(shm_comm *c, int kind, size_t nbytes, int arm, int64_t t0)
{
    if (!t0)
        return;
    int64_t dt = now_ns() - t0;
    tune_t *t = &c->tune[kind][bucket_of(kind, nbytes)];
    if (dt > 0 && dt < t->best[arm])
        t->best[arm] = dt;
}

void shm_comm_set_ar_algo(shm_comm *c, int algo)
{
    c->ar_algo = algo == SHM_AR_TWO_SHOT || algo == SHM_AR_SINGLE_COPY ? algo : SHM_AR_AUTO;
}

int shm_comm_tune_choice(const shm_comm *c, int kind, size_t nbytes)
{
    if (kind < 0 || kind >= TUNE_KINDS)
        return -1;
    const tune_t *t = &c->tune[kind][bucket_of(kind, nbytes)];
    return t->gap && t->arm < TUNE_ARMS ? t->arm : -1;
}
