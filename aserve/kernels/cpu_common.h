#ifndef ASERVE_CPU_COMMON_H
#define ASERVE_CPU_COMMON_H

/* Shared by aserve's CPU kernels (cpu_ops.c: the decode step's small ops; cpu_matmul.c: matrix products).
 *
 * Built at first use by aserve/kernels/cpu_ops.py (`cc -O3 -march=native -fopenmp -shared`), loaded with
 * ctypes; the Python side checks shapes, dtypes and contiguity, so these functions trust their input.
 * Arithmetic is fp32 inside with one rounding to bf16 per output (round to nearest even, as torch).
 * OpenMP here shares torch's runtime (the .so is loaded after torch's libgomp), so it uses torch's
 * thread count and pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The packed matrix products' AVX2 + FMA form (cpu_matmul_avx2.c), for CPUs without AVX512-BF16. */
#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ASERVE_PACKED_AVX2 1
#else
#define ASERVE_PACKED_AVX2 0
#endif

/* Decode attention's AVX2 + FMA form (cpu_attention_avx2.c), for CPUs without AVX512. */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define ASERVE_ATTEND_AVX2 1
#else
#define ASERVE_ATTEND_AVX2 0
#endif

#define MAX_GROUP 16 /* query heads per KV head, at most (cpu_ops.py checks) */

typedef uint16_t bf16;

#if defined(__AVX512F__)
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

static inline float bf16_to_f32(bf16 h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline bf16 f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    const uint32_t u = v.u;
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16)((u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40u) : rounded); /* NaN stays a quiet NaN */
}

/* y[at + c] = v[c] (+ bias[c]) for c < n, as fp32 when y_f32, else rounded to bf16. */
static inline void store_outputs(void *y, int64_t at, const float *v, const bf16 *bias, int64_t n, int64_t y_f32) {
    for (int64_t c = 0; c < n; c++) {
        const float o = v[c] + (bias ? bf16_to_f32(bias[c]) : 0.0f);
        if (y_f32) ((float *)y)[at + c] = o;
        else ((bf16 *)y)[at + c] = f32_to_bf16(o);
    }
}

/* Each row's sum of x over each group of gs columns, fp32 [M, K / gs] (malloc'd; NULL when it cannot be):
 * the 4-bit products' offset term. */
static inline float *row_group_sums(const bf16 *x, int64_t x_stride, int64_t M, int64_t K, int64_t gs) {
    const int64_t groups = K / gs;
    float *sums = malloc((size_t)(M * groups) * sizeof(float));
    if (!sums) return NULL;
    for (int64_t i = 0; i < M; i++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) s += bf16_to_f32(x[i * x_stride + k]);
            sums[i * groups + g] = s;
        }
    return sums;
}

/* exp(x): Cody-Waite range reduction and a degree-6 polynomial, within ~2 ulp of expf for
 * x in [-87, 88] (0 below, inf above); plain arithmetic and selects (no branches), so the loops that call
 * it vectorize. */
/* Decode attention's state for the G query heads of one KV head before its first key: the queries in fp32
 * times `scale`, empty sums, running maxima of -inf and denominators of 0 (D a constant where inlined). */
static inline __attribute__((always_inline)) void start_heads(const bf16 *q, int64_t G, const int64_t D, float scale,
                                                              float *qf, float *acc, float *m, float *l) {
    for (int64_t h = 0; h < G; h++) {
        for (int64_t i = 0; i < D; i++) {
            qf[h * D + i] = bf16_to_f32(q[h * D + i]) * scale;
            acc[h * D + i] = 0.0f;
        }
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
}

/* fast_exp's constants, shared by its vector forms (exp16 below, exp8 in cpu_attention_avx2.c): log2(e), ln(2)
 * in a high part exact in few bits and a low remainder, and the polynomial's coefficients (degree 5). */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO 2.12194440e-4f
#define EXP_P5 1.9875691500e-4f
#define EXP_P4 1.3981999507e-3f
#define EXP_P3 8.3334519073e-3f
#define EXP_P2 4.1665795894e-2f
#define EXP_P1 1.6666665459e-1f
#define EXP_P0 5.0000001201e-1f

static inline float fast_exp(float x) {
    const float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* round to nearest even (as nearbyintf, which does not vectorize): |x log2 e| < 2^22 here */
    float n = (xc * EXP_LOG2E + 12582912.0f) - 12582912.0f;
    float r = xc - n * EXP_LN2_HI;
    r = r + n * EXP_LN2_LO;
    float p = EXP_P5;
    p = p * r + EXP_P4;
    p = p * r + EXP_P3;
    p = p * r + EXP_P2;
    p = p * r + EXP_P1;
    p = p * r + EXP_P0;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    const float e = p * scale.f;
    return x < -87.0f ? 0.0f : (x > 88.0f ? INFINITY : e);
}

/* The cache slots of keys [c0, c0 + n) of a sequence whose blocks are `table` (no division per key). */
static inline void key_slots(const int32_t *table, int64_t c0, int64_t n, int64_t block_size, int64_t *slot) {
    for (int64_t j = 0, block = c0 / block_size, offset = c0 % block_size; j < n; j++) {
        slot[j] = (int64_t)table[block] * block_size + offset;
        if (++offset == block_size) {
            offset = 0;
            block++;
        }
    }
}

/* The end of one KV head's decode attention over its keys: the G heads' sums acc [G, D], running maxima m and
 * totals l either kept as a split's state in partial [G * D sums, G maxima, G totals] (merged by merge_splits),
 * or, partial NULL, normalized into out [G, D]. */
static inline void finish_heads(const float *acc, const float *m, const float *l, int64_t G, int64_t D, bf16 *out,
                                float *partial) {
    if (partial) {
        memcpy(partial, acc, (size_t)(G * D) * sizeof(float));
        memcpy(partial + G * D, m, (size_t)G * sizeof(float));
        memcpy(partial + G * D + G, l, (size_t)G * sizeof(float));
        return;
    }
    for (int64_t h = 0; h < G; h++) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int64_t i = 0; i < D; i++) out[h * D + i] = f32_to_bf16(acc[h * D + i] * inv);
    }
}

/* Runs CALL with HEAD_D a compile-time 64 or 128 where D is one of them (an always-inline callee's loops over
 * the head unroll), else D. */
#define WITH_HEAD_SIZE(D, CALL)                                                                                     \
    do {                                                                                                            \
        if ((D) == 64) {                                                                                            \
            const int64_t HEAD_D = 64;                                                                              \
            CALL;                                                                                                   \
        } else if ((D) == 128) {                                                                                    \
            const int64_t HEAD_D = 128;                                                                             \
            CALL;                                                                                                   \
        } else {                                                                                                    \
            const int64_t HEAD_D = (D);                                                                             \
            CALL;                                                                                                   \
        }                                                                                                           \
    } while (0)

/* out [G, D] from the states of S splits of one KV head's keys (each [G * D acc, G max, G sum]). */
static inline void merge_splits(const float *parts, int64_t S, int64_t G, int64_t D, bf16 *out) {
    const int64_t width = G * D + 2 * G;
    for (int64_t h = 0; h < G; h++) {
        float mx = -INFINITY, total = 0.0f, w[S];
        for (int64_t s = 0; s < S; s++) {
            const float ms = parts[s * width + G * D + h];
            mx = ms > mx ? ms : mx;
        }
        for (int64_t s = 0; s < S; s++) {
            const float *p = parts + s * width;
            w[s] = p[G * D + G + h] > 0.0f ? expf(p[G * D + h] - mx) : 0.0f;
            total += p[G * D + G + h] * w[s];
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t i = 0; i < D; i++) {
            float v = 0.0f;
            for (int64_t s = 0; s < S; s++)
                if (w[s] > 0.0f) v += parts[s * width + h * D + i] * w[s]; /* an empty split's acc is unset */
            out[h * D + i] = f32_to_bf16(v * inv);
        }
    }
}

#define ATTEND_SPLIT_ITEMS 16    /* split decode attention (AVX2 form): fewer (sequence, KV head) pairs */
#define ATTEND_SPLIT_MIN_KEYS 128 /* keys per run, at least */
#if ASERVE_ATTEND_AVX2
/* The G query heads q [G, D] (sharing KV head g) attended over keys [start, len) of the sequence whose blocks
 * are `table`, into out [G, D]; with `partial`, the unnormalized state [G * D sums, G maxima, G totals]
 * instead (cpu_attention_avx2.c). D % 8 == 0. */
void attend_avx2(const bf16 *q, bf16 *out, const bf16 *k_cache, const bf16 *v_cache, const int32_t *table,
                 int64_t start, int64_t len, int64_t row, int64_t g, int64_t G, int64_t D, int64_t block_size,
                 float scale, float softcap, float *partial);
/* Runs of keys each sequence's decode attention is split into on this form: 1 unless the batch has fewer
 * than ATTEND_SPLIT_ITEMS (sequence, KV head) pairs and a sequence has keys for two runs of
 * ATTEND_SPLIT_MIN_KEYS. The same for any thread count, so the results are too. */
int64_t attend_avx2_splits(const int32_t *seq_lens, int64_t B, int64_t KVH, int64_t window);
/* Split sp of S of sequence b's keys for KV head g (q [B, H, D]) into part [G * D + 2 G] (attend_avx2's
 * partial form; an empty run gives maxima -inf and totals 0). */
void attend_avx2_split(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int32_t *block_tables,
                       int64_t bt_stride, const int32_t *seq_lens, int64_t b, int64_t sp, int64_t S, int64_t g,
                       int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t window, float scale,
                       float softcap, float *part);
#endif

#if defined(__AVX512F__)
/* exp(x) on 16 lanes (fast_exp's polynomial); lanes below -87, -inf included, give 0. */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 live = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P5);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P0));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

/* Scores capped as softcap * tanh(s / softcap) (Gemma 2), lane by lane. */
static inline __m512 cap_scores(__m512 s, float softcap) {
    float v[16];
    _mm512_storeu_ps(v, s);
    for (int j = 0; j < 16; j++) v[j] = softcap * tanhf(v[j] / softcap);
    return _mm512_loadu_ps(v);
}

/* One online-softmax update of a row: its next nv vectors of scores s (scaled, capped; invisible lanes
 * -inf) fold into its running max *m and sum *l and become probabilities exp(s - max); returns the
 * factor the row's accumulated output must be multiplied by (0 while the row had seen nothing). Scores
 * with no visible key leave the row as it was: zeros, factor 1. */
static inline float softmax_chunk(__m512 *s, int64_t nv, float *m, float *l) {
    __m512 mx_v = s[0];
    for (int64_t t = 1; t < nv; t++) mx_v = _mm512_max_ps(mx_v, s[t]);
    const float chunk_max = _mm512_reduce_max_ps(mx_v);
    if (chunk_max == -INFINITY) {
        for (int64_t t = 0; t < nv; t++) s[t] = _mm512_setzero_ps();
        return 1.0f;
    }
    const float mx = chunk_max > *m ? chunk_max : *m;
    const float corr = fast_exp(*m - mx);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < nv; t++) {
        s[t] = exp16(_mm512_sub_ps(s[t], _mm512_set1_ps(mx)));
        sum = _mm512_add_ps(sum, s[t]);
    }
    *l = *l * corr + _mm512_reduce_add_ps(sum);
    *m = mx;
    return corr;
}
#endif

/* This thread's share [*begin, *end) of `units` output units, cut in whole multiples of `multiple`
 * (call inside a parallel region; each thread then streams its own contiguous part of the weight). */
static inline void thread_share(int64_t units, int64_t multiple, int64_t *begin, int64_t *end) {
#if defined(_OPENMP)
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
    const int64_t nt = 1, t = 0;
#endif
    const int64_t per = ((units + nt - 1) / nt + multiple - 1) / multiple * multiple;
    *begin = t * per < units ? t * per : units;
    *end = (*begin + per) < units ? (*begin + per) : units;
}

/* Chunks of a parallel loop shared with stealing: each thread starts on its own contiguous range (one
 * long weight stream, as with thread_share) from the front, then takes chunks from the back of the other
 * threads' ranges. A thread the OS or the hypervisor pauses (on a small VM the server's own threads run
 * on the same cores) then delays the loop by about its share of the pause, not by all of it. Each range
 * packs its next (low 32 bits) and end (high 32 bits) chunk in one word claimed by compare-and-swap.
 * Fill with shared_chunks_init before the parallel region; a team smaller than it planned for (an `if`
 * clause, fewer threads) leaves ranges with no owner, which the others steal. */
#define SHARED_CHUNKS_TEAM 64
typedef struct {
    uint64_t range[SHARED_CHUNKS_TEAM];
    int64_t ranges, units, per_chunk;
} shared_chunks;

/* `units` (columns, groups of columns, ...) in chunks of `per_chunk` (the last may be shorter). */
static inline void shared_chunks_init(shared_chunks *w, int64_t units, int64_t per_chunk) {
    const int64_t chunks = (units + per_chunk - 1) / per_chunk;
    w->units = units;
    w->per_chunk = per_chunk;
#if defined(_OPENMP)
    int64_t nt = omp_get_max_threads();
#else
    int64_t nt = 1;
#endif
    nt = nt < SHARED_CHUNKS_TEAM ? nt : SHARED_CHUNKS_TEAM;
    const int64_t per = (chunks + nt - 1) / nt;
    for (int64_t t = 0; t < nt; t++) {
        const uint64_t lo = (uint64_t)(t * per < chunks ? t * per : chunks);
        const uint64_t hi = (uint64_t)((t + 1) * per < chunks ? (t + 1) * per : chunks);
        w->range[t] = lo | (hi << 32);
    }
    w->ranges = nt;
}

/* The next chunk index from a range word (next | end << 32): its front (front != 0) or its back; -1 when
 * it is empty. */
static inline int64_t range_claim(uint64_t *range, int front) {
    uint64_t cur = __atomic_load_n(range, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t lo = cur & 0xFFFFFFFFu, hi = cur >> 32;
        if (lo >= hi) return -1;
        const uint64_t next = front ? (lo + 1) | (hi << 32) : lo | ((hi - 1) << 32);
        if (__atomic_compare_exchange_n(range, &cur, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return (int64_t)(front ? lo : hi - 1);
    }
}

/* This thread's next chunk index (call inside the parallel region with *cursor = 0 at first), or -1 when
 * every chunk has been claimed. */
static inline int64_t shared_chunks_claim_next(shared_chunks *w, int64_t *cursor) {
#if defined(_OPENMP)
    const int64_t t = omp_get_thread_num();
#else
    const int64_t t = 0;
#endif
    for (; *cursor < w->ranges; (*cursor)++) {
        const int64_t r = (t + *cursor) % w->ranges;
        const int64_t c = range_claim(&w->range[r], *cursor == 0 && t < w->ranges);
        if (c >= 0) return c;
    }
    return -1;
}

/* This thread's next chunk as its first unit and unit count; 0 when every chunk has been claimed. */
static inline int shared_chunks_next(shared_chunks *w, int64_t *cursor, int64_t *first, int64_t *count) {
    const int64_t c = shared_chunks_claim_next(w, cursor);
    if (c < 0) return 0;
    *first = c * w->per_chunk;
    *count = (w->units - *first) < w->per_chunk ? (w->units - *first) : w->per_chunk;
    return 1;
}

/* The kernels cpu_decode_step.c composes (defined in cpu_ops.c and cpu_matmul.c; declared here so the
 * compiler checks every definition against its use). */
void add_rms_norm_bf16(const void *x, int64_t x_stride, int64_t x_f32, const void *residual, int64_t res_stride,
                       int64_t residual_f32, const bf16 *weight, bf16 *out, float *sum_out, int64_t rows,
                       int64_t n, float eps, float weight_offset);
void rotary_neox_bf16(const bf16 *q, int64_t q_stride, const bf16 *k, int64_t k_stride, const bf16 *cos_sin,
                      bf16 *q_out, bf16 *k_out, int64_t tokens, int64_t q_heads, int64_t k_heads,
                      int64_t head_dim, int64_t half);
void add_layer_norm_bf16(const void *x, int64_t x_stride, int64_t x_f32, const void *residual, int64_t res_stride,
                         int64_t residual_f32, const bf16 *weight, const bf16 *bias, bf16 *out, float *sum_out,
                         int64_t rows, int64_t n, float eps);
/* Activations by number (act_bf16 and the decode step's layers): gated ones take [rows, 2n] (gate | up). */
enum { ACT_SILU_AND_MUL = 0, ACT_GELU_TANH_AND_MUL = 1, ACT_GELU_TANH = 2, ACT_RELU = 3, ACT_GELU = 4 };
void act_bf16(const void *x, int64_t x_stride, int64_t x_f32, bf16 *out, int64_t rows, int64_t n, int64_t kind);
void silu_and_mul_bf16(const void *x, int64_t x_stride, int64_t x_f32, bf16 *out, int64_t rows, int64_t n);
void gelu_tanh_and_mul_bf16(const void *x, int64_t x_stride, int64_t x_f32, bf16 *out, int64_t rows, int64_t n);
void paged_decode_attention_bf16(const bf16 *q, bf16 *out, bf16 *k_cache, bf16 *v_cache,
                                 const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                                 const int64_t *slots, const bf16 *k_new, int64_t k_stride, const bf16 *v_new,
                                 int64_t v_stride, int64_t B, int64_t H, int64_t KVH, int64_t D,
                                 int64_t block_size, int64_t window, float scale, float softcap);
int64_t linear_vnni_bf16(const bf16 *x, int64_t x_stride, const bf16 *w_packed, const bf16 *bias, void *y,
                         int64_t y_stride, int64_t M, int64_t N, int64_t K, int64_t y_f32);
void linear_bf16(const bf16 *x, int64_t x_stride, const bf16 *w, const bf16 *bias, void *y, int64_t y_stride,
                 int64_t M, int64_t N, int64_t K, int64_t y_f32);
int64_t linear_int4_bf16(const bf16 *x, int64_t x_stride, const uint8_t *q_packed, const uint16_t *d,
                         const uint16_t *m, const bf16 *bias, void *y, int64_t y_stride, int64_t M, int64_t N,
                         int64_t K, int64_t y_f32, int64_t gs);
#if ASERVE_PACKED_AVX2 /* the same contracts as the two above (cpu_matmul_avx2.c); -2: out of memory */
int64_t linear_vnni_avx2(const bf16 *x, int64_t x_stride, const bf16 *w_packed, const bf16 *bias, void *y,
                         int64_t y_stride, int64_t M, int64_t N, int64_t K, int64_t y_f32);
int64_t linear_int4_avx2(const bf16 *x, int64_t x_stride, const uint8_t *q_packed, const uint16_t *d,
                         const uint16_t *m, const bf16 *bias, void *y, int64_t y_stride, int64_t M, int64_t N,
                         int64_t K, int64_t y_f32, int64_t gs);
#endif

#endif /* ASERVE_CPU_COMMON_H */
