#ifndef ASERVE_CPU_TEAM_H
#define ASERVE_CPU_TEAM_H

/* A step's ops on one OpenMP team with no barrier between them, and chunks a paused thread holds taken
 * over by the others ("rescued").
 *
 * With OpenMP regions per kernel, a thread the OS pauses in the middle of a chunk (on a 2-vCPU machine the
 * server's and the client's threads run on the same cores) stalls the whole region at its closing barrier
 * until it runs again: every other core waits out the pause. Here the whole decode step is one region;
 * every thread walks the same sequence of ops (numbered in order, the same on every thread):
 *   - a serial op (a norm, rotary, the cache write) is run by the first thread to reach it, once the op
 *     before it is complete; the others go on to the next op;
 *   - a parallel op's chunks are claimed as in shared_chunks (a contiguous range each, then stealing);
 *     a chunk computes its results into the thread's own memory and stores them only after winning its
 *     state (chunk_commit_begin). A thread with nothing left to claim waits for the op's other chunks;
 *     past a grace period (twice its own slowest chunk, at least TEAM_GRACE_NS) it takes over any chunk
 *     still unstored and computes it itself. The slow owner, when it runs again, loses the race and
 *     discards its results. So an op completes at the pace of the threads that run, and a paused thread
 *     costs about its share of the work, not the pause.
 * An op's inputs are complete before anyone starts it (op_done), its outputs are stored exactly once per
 * chunk, and a chunk is computed from inputs no later op has touched yet, except by a thread that will
 * lose the race (whose reads are then of memory that stays allocated for the step: never a fault). So
 * chunk functions must compute from the op's inputs and the step's scratch only, and derive no address
 * from data a later op writes. Serial ops are never taken over (their stores are not deferred).
 * TEAM_MAX_THREADS bounds the team; the caller falls back to per-kernel regions beyond it. */
#include "cpu_common.h"
#include <sched.h>
#include <time.h>

#define TEAM_MAX_THREADS 16
#define TEAM_GRACE_NS 20000

enum { CHUNK_FREE = 0, CHUNK_CLAIMED, CHUNK_STORING, CHUNK_DONE, CHUNK_RESCUED };

/* A chunk's right to store: state NULL means no team (always store). */
typedef struct {
    uint8_t *state;
    uint8_t expect; /* CHUNK_CLAIMED (its owner) or CHUNK_RESCUED (a rescuer) */
    uint8_t stored;
} chunk_commit;

/* 1 when the caller may store the chunk's results now (it then calls chunk_commit_end after storing). */
static inline int chunk_commit_begin(chunk_commit *c) {
    if (!c || !c->state) return 1;
    uint8_t expect = c->expect;
    return __atomic_compare_exchange_n(c->state, &expect, CHUNK_STORING, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

static inline void chunk_commit_end(chunk_commit *c) {
    if (!c || !c->state) return;
    __atomic_store_n(c->state, CHUNK_DONE, __ATOMIC_RELEASE);
    c->stored = 1;
}

typedef void (*team_chunk_fn)(const void *arg, int64_t chunk, chunk_commit *commit);

typedef struct {
    int64_t init;    /* 0: untouched, 1: being set up, 2: ready */
    int64_t taken;   /* serial ops: 1 once a thread took it */
    int64_t done;    /* chunks stored */
    int64_t chunks;
    uint64_t range[TEAM_MAX_THREADS];
    uint8_t *state;
} team_op;

typedef struct {
    team_op *ops;
    uint8_t *states; /* max_chunks per op */
    int64_t num_ops, max_chunks, threads;
    int64_t op_done; /* ops complete, in order */
    int64_t rescued; /* chunks taken over (a count for tests and logs) */
} team;

static inline void team_relax(int64_t *spins) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if (++*spins > 4096) { /* a long wait: let a thread sharing this core run (the one waited for, perhaps) */
        sched_yield();
        *spins = 0;
    }
}

static inline int64_t team_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Waits until every op before `op` is complete. */
static inline void team_wait(team *t, int64_t op) {
    int64_t spins = 0;
    while (__atomic_load_n(&t->op_done, __ATOMIC_ACQUIRE) < op) team_relax(&spins);
}

/* 1 when this thread runs serial op `op` (it then calls team_serial_end); 0 when another took it. */
static inline int team_serial_begin(team *t, int64_t op) {
    if (__atomic_load_n(&t->op_done, __ATOMIC_ACQUIRE) > op) return 0;
    int64_t free_ = 0;
    if (!__atomic_compare_exchange_n(&t->ops[op].taken, &free_, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) return 0;
    team_wait(t, op);
    return 1;
}

static inline void team_serial_end(team *t, int64_t op) { __atomic_store_n(&t->op_done, op + 1, __ATOMIC_RELEASE); }

static inline void team_chunk_stored(team *t, team_op *o, int64_t op) {
    if (__atomic_add_fetch(&o->done, 1, __ATOMIC_ACQ_REL) == o->chunks)
        __atomic_store_n(&t->op_done, op + 1, __ATOMIC_RELEASE);
}

/* Computes chunk c under `expect` (the state this thread won it in) and counts it if it stored. */
static inline int64_t team_run_chunk(team *t, team_op *o, int64_t op, int64_t c, uint8_t expect, team_chunk_fn fn,
                                     const void *arg) {
    const int64_t start = team_now_ns();
    chunk_commit commit = {o->state + c, expect, 0};
    fn(arg, c, &commit);
    if (commit.stored) team_chunk_stored(t, o, op);
    return team_now_ns() - start;
}

/* Parallel op `op` of `chunks` chunks (at most t->max_chunks) on thread `me`: returns once every chunk is
 * stored (by anyone). */
static inline void team_parallel(team *t, int64_t op, int64_t me, int64_t chunks, team_chunk_fn fn,
                                 const void *arg) {
    team_op *o = &t->ops[op];
    if (__atomic_load_n(&t->op_done, __ATOMIC_ACQUIRE) > op) return;
    team_wait(t, op);
    int64_t unset = 0, spins = 0;
    if (__atomic_compare_exchange_n(&o->init, &unset, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
        const int64_t nt = t->threads, per = (chunks + nt - 1) / nt;
        for (int64_t r = 0; r < nt; r++) {
            const uint64_t lo = (uint64_t)(r * per < chunks ? r * per : chunks);
            const uint64_t hi = (uint64_t)((r + 1) * per < chunks ? (r + 1) * per : chunks);
            o->range[r] = lo | (hi << 32);
        }
        o->chunks = chunks;
        o->state = t->states + op * t->max_chunks;
        memset(o->state, CHUNK_FREE, (size_t)chunks);
        __atomic_store_n(&o->init, 2, __ATOMIC_RELEASE);
        if (chunks == 0) __atomic_store_n(&t->op_done, op + 1, __ATOMIC_RELEASE);
    } else {
        while (__atomic_load_n(&o->init, __ATOMIC_ACQUIRE) != 2) team_relax(&spins);
    }
    int64_t slowest = 0;
    for (int64_t cursor = 0; cursor < t->threads; cursor++) {
        const int64_t r = (me + cursor) % t->threads;
        int64_t c;
        while ((c = range_claim(&o->range[r], cursor == 0)) >= 0) {
            uint8_t free_ = CHUNK_FREE;
            if (!__atomic_compare_exchange_n(o->state + c, &free_, CHUNK_CLAIMED, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
                continue; /* taken over before this thread got to it */
            const int64_t took = team_run_chunk(t, o, op, c, CHUNK_CLAIMED, fn, arg);
            slowest = took > slowest ? took : slowest;
        }
    }
    const int64_t grace = 2 * slowest > TEAM_GRACE_NS ? 2 * slowest : TEAM_GRACE_NS;
    int64_t deadline = team_now_ns() + grace;
    while (__atomic_load_n(&t->op_done, __ATOMIC_ACQUIRE) <= op) {
        if ((spins & 63) == 0 && team_now_ns() > deadline) {
            for (int64_t c = 0; c < o->chunks; c++) {
                uint8_t s = __atomic_load_n(o->state + c, __ATOMIC_ACQUIRE);
                if ((s == CHUNK_FREE || s == CHUNK_CLAIMED) &&
                    __atomic_compare_exchange_n(o->state + c, &s, CHUNK_RESCUED, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
                    __atomic_add_fetch(&t->rescued, 1, __ATOMIC_RELAXED);
                    team_run_chunk(t, o, op, c, CHUNK_RESCUED, fn, arg);
                }
            }
            deadline = team_now_ns() + grace;
        }
        team_relax(&spins);
    }
}

/* A team for up to `num_ops` ops of at most `max_chunks` chunks each; 0, or -2 when out of memory. */
static inline int64_t team_init(team *t, int64_t num_ops, int64_t max_chunks, int64_t threads) {
    t->ops = calloc((size_t)num_ops, sizeof(team_op));
    t->states = malloc((size_t)(num_ops * max_chunks));
    t->num_ops = num_ops;
    t->max_chunks = max_chunks;
    t->threads = threads;
    t->op_done = 0;
    t->rescued = 0;
    if (!t->ops || !t->states) {
        free(t->ops);
        free(t->states);
        return -2;
    }
    return 0;
}

static inline void team_free(team *t) {
    free(t->ops);
    free(t->states);
}

#endif /* ASERVE_CPU_TEAM_H */
