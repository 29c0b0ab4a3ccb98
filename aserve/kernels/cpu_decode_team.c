/* The decode step's ops on one team (cpu_team.h): step_matmul and step_attention as team ops, the team's
 * set-up for decode_layers_bf16 (cpu_decode_step.c), and team_selftest, which runs the protocol with a
 * thread made to stall inside its chunks (tests/kernels/test_cpu_team.py). Without a team the step's
 * functions call the kernels as they are (each with its own OpenMP region). */
#include "cpu_decode.h"

typedef struct {
    const decode_matmul *m;
    const bf16 *x;
    int64_t k, rows;
    void *y;
    const step_worker *w;
} matmul_op;

static void matmul_chunk(const void *arg, int64_t chunk, chunk_commit *commit) {
    const matmul_op *a = arg;
    const decode_matmul *m = a->m;
    if (m->kind == 2) {
        const int64_t n0 = chunk * 4, nb = (m->n - n0) < 4 ? (m->n - n0) : 4;
        linear_bf16_chunk(a->x, a->k, (const bf16 *)m->weight, m->bias, a->y, m->n, a->rows, m->n, a->k, m->y_f32, n0,
                          nb, commit);
        return;
    }
#if ASERVE_PACKED_AVX2 && !defined(__AVX512BF16__)
    if (m->kind == 0) {
        const int64_t per = vnni_avx2_chunk_groups(a->rows), g0 = chunk * per;
        const int64_t ng = (m->n / 16 - g0) < per ? (m->n / 16 - g0) : per;
        vnni_avx2_chunk(a->w->xf, (const bf16 *)m->weight, m->bias, a->y, m->n, a->rows, a->k, m->y_f32, g0, ng, commit);
        return;
    }
    int4_avx2_chunk(&a->w->rows, (const uint8_t *)m->weight, (const uint16_t *)m->scale, (const uint16_t *)m->offset,
                    m->bias, a->y, m->n, a->rows, a->k, m->y_f32, m->group_size, chunk, commit);
#endif
}

/* How many chunks matmul_chunk cuts m into for `rows` rows. */
static int64_t matmul_chunks(const decode_matmul *m, int64_t rows) {
#if ASERVE_PACKED_AVX2 && !defined(__AVX512BF16__)
    if (m->kind == 0) {
        const int64_t per = vnni_avx2_chunk_groups(rows);
        return (m->n / 16 + per - 1) / per;
    }
    if (m->kind == 1) return m->n / 16;
#endif
    (void)rows;
    return (m->n + 3) / 4;
}

int64_t step_matmul(step_worker *w, const decode_matmul *m, const bf16 *x, int64_t k, void *y, int64_t rows) {
    if (!w->team) return decode_matmul_run(m, x, k, y, rows);
#if ASERVE_PACKED_AVX2 && !defined(__AVX512BF16__)
    if (m->kind != 2 && step_serial_take(w)) { /* x prepared once, in the step's scratch */
        if (m->kind == 0) vnni_avx2_rows(x, k, rows, k, w->xf);
        else int4_avx2_rows(x, k, rows, k, m->group_size, &w->rows);
        step_serial_done(w);
    }
#endif
    const matmul_op a = {m, x, k, rows, y, w};
    team_parallel(w->team, w->op++, w->me, matmul_chunks(m, rows), matmul_chunk, &a);
    return 0;
}

typedef struct {
    const bf16 *q;
    bf16 *out;
    const bf16 *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens;
    int64_t bt_stride, H, KVH, D, block_size, window;
    float scale, softcap;
    int64_t splits; /* runs of each sequence's keys (1: none) */
    float *parts;   /* [B, KVH, splits, G * D + 2 G]: the runs' states (the step's scratch) */
} attention_op;

static void attention_chunk(const void *arg, int64_t chunk, chunk_commit *commit) {
    const attention_op *a = arg;
    decode_attention_item(a->q, a->out, a->k_cache, a->v_cache, a->block_tables, a->bt_stride, a->seq_lens,
                          chunk / a->KVH, chunk % a->KVH, a->H, a->KVH, a->D, a->block_size, a->window, a->scale,
                          a->softcap, commit);
}

#if ASERVE_ATTEND_AVX2
/* Chunk (b, sp, g) (in that order: a thread's range holds whole runs of keys, every KV head in turn). */
static void attention_split_chunk(const void *arg, int64_t chunk, chunk_commit *commit) {
    const attention_op *a = arg;
    const int64_t S = a->splits, G = a->H / a->KVH, width = G * a->D + 2 * G;
    const int64_t b = chunk / (S * a->KVH), sp = chunk / a->KVH % S, g = chunk % a->KVH;
    float part[width];
    attend_avx2_split(a->q, a->k_cache, a->v_cache, a->block_tables, a->bt_stride, a->seq_lens, b, sp, S, g, a->H,
                      a->KVH, a->D, a->block_size, a->window, a->scale, a->softcap, part);
    if (!chunk_commit_begin(commit)) return;
    memcpy(a->parts + ((b * a->KVH + g) * S + sp) * width, part, (size_t)width * sizeof(float));
    chunk_commit_end(commit);
}

/* Chunk (b, g): its runs' states merged into the output's G heads. */
static void attention_merge_chunk(const void *arg, int64_t chunk, chunk_commit *commit) {
    const attention_op *a = arg;
    const int64_t G = a->H / a->KVH, width = G * a->D + 2 * G, b = chunk / a->KVH, g = chunk % a->KVH;
    bf16 kept[G * a->D];
    merge_splits(a->parts + chunk * a->splits * width, a->splits, G, a->D, kept);
    if (!chunk_commit_begin(commit)) return;
    memcpy(a->out + (b * a->H + g * G) * a->D, kept, (size_t)(G * a->D) * sizeof(bf16));
    chunk_commit_end(commit);
}
#endif

void step_attention(step_worker *w, const bf16 *q, bf16 *out, bf16 *k_cache, bf16 *v_cache,
                    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, const int64_t *slots,
                    const bf16 *k_new, int64_t k_stride, const bf16 *v_new, int64_t v_stride, int64_t B, int64_t H,
                    int64_t KVH, int64_t D, int64_t block_size, int64_t window, float scale, float softcap) {
    if (!w->team) {
        paged_decode_attention_bf16(q, out, k_cache, v_cache, block_tables, bt_stride, seq_lens, slots, k_new, k_stride,
                                    v_new, v_stride, B, H, KVH, D, block_size, window, scale, softcap);
        return;
    }
    const int64_t row = KVH * D;
    if (slots && step_serial_take(w)) { /* the new keys and values, as paged_decode_attention_bf16 writes them */
        for (int64_t b = 0; b < B; b++) {
            if (slots[b] < 0) continue;
            memcpy(k_cache + slots[b] * row, k_new + b * k_stride, (size_t)row * sizeof(bf16));
            memcpy(v_cache + slots[b] * row, v_new + b * v_stride, (size_t)row * sizeof(bf16));
        }
        step_serial_done(w);
    }
    const attention_op a = {q, out, k_cache, v_cache, block_tables, seq_lens, bt_stride, H, KVH, D, block_size,
                            window, scale, softcap, 1, w->parts};
#if ASERVE_ATTEND_AVX2
    const int64_t S = D % 8 == 0 ? attend_avx2_splits(seq_lens, B, KVH, window) : 1;
    if (S > 1) { /* (sequence, run of keys, KV head) items into the step's parts, then each pair merged */
        attention_op split = a;
        split.splits = S;
        team_parallel(w->team, w->op++, w->me, B * S * KVH, attention_split_chunk, &split);
        team_parallel(w->team, w->op++, w->me, B * KVH, attention_merge_chunk, &split);
        return;
    }
#endif
    team_parallel(w->team, w->op++, w->me, B * KVH, attention_chunk, &a);
}

/* team_selftest's op: y_op[c] = y_(op-1)[c] * 3 + c + (the sum of y_(op-1) over a neighbour window), one
 * chunk per element, each made to last 5 us (so every thread gets chunks); `stall` makes thread 1 sleep 2 ms
 * before storing every stall-th chunk it computes. */
typedef struct {
    const int64_t *prev;
    int64_t *next, n, stall, me;
    int64_t *seen;
} selftest_op;

static int64_t selftest_value(const int64_t *prev, int64_t n, int64_t c) {
    int64_t v = prev[c] * 3 + c;
    for (int64_t j = c - 2; j <= c + 2; j++) v += prev[(j + n) % n];
    return v % 1000003;
}

static void selftest_chunk(const void *arg, int64_t chunk, chunk_commit *commit) {
    const selftest_op *a = arg;
    const int64_t v = selftest_value(a->prev, a->n, chunk), until = team_now_ns() + 5000;
    while (team_now_ns() < until) continue;
    if (a->me == 1 && a->stall && ++*a->seen % a->stall == 0) {
        const struct timespec pause = {0, 2000000};
        nanosleep(&pause, NULL);
    }
    if (!chunk_commit_begin(commit)) return;
    a->next[chunk] = v;
    chunk_commit_end(commit);
}

/* Runs `ops` ops of n chunks on `threads` threads (thread 1 stalling as above) and checks the result
 * against one thread's: the number of chunks taken over (>= 0), or -1 on a wrong result, -2 out of memory. */
int64_t team_selftest(int64_t ops, int64_t n, int64_t threads, int64_t stall) {
    int64_t *buf = malloc((size_t)((ops + 1) * n) * sizeof(int64_t)), *ref = malloc((size_t)(2 * n) * sizeof(int64_t));
    team t;
    if (!buf || !ref || team_init(&t, ops, n, threads)) {
        free(buf);
        free(ref);
        return -2;
    }
    for (int64_t c = 0; c < n; c++) buf[c] = ref[c] = c * 7 + 1;
#pragma omp parallel num_threads(threads)
    {
        int64_t seen = 0;
        const int64_t me = omp_get_thread_num();
        for (int64_t op = 0; op < ops; op++) {
            const selftest_op a = {buf + op * n, buf + (op + 1) * n, n, stall, me, &seen};
            team_parallel(&t, op, me, n, selftest_chunk, &a);
        }
    }
    int64_t result = t.rescued;
    for (int64_t op = 0; op < ops; op++) {
        int64_t *prev = ref + (op % 2) * n, *next = ref + ((op + 1) % 2) * n;
        for (int64_t c = 0; c < n; c++) next[c] = selftest_value(prev, n, c);
    }
    for (int64_t c = 0; c < n; c++)
        if (buf[ops * n + c] != ref[(ops % 2) * n + c]) result = -1;
    team_free(&t);
    free(buf);
    free(ref);
    return result;
}
