#ifndef ASERVE_CPU_DECODE_H
#define ASERVE_CPU_DECODE_H

/* The structs of the native decode step (cpu_decode_step.c, cpu_decode_moe.c); filled by
 * aserve/runner/cpu_decode_layers.py (ctypes Structures with the same fields in the same order). */
#include "cpu_team.h"

/* x rounded for the AVX2 4-bit product (cpu_matmul_avx2.c): 15-bit integers xq = 128 xh + xl per 32 with
 * their scales, and the sums of x per group of gs. */
typedef struct {
    int8_t *xh, *xl; /* [M, K] */
    float *xs;       /* [M, K / 32] */
    float *xsum;     /* [M, K / gs]: sums of x as given */
} int4_rows;

/* One weight: kind 0 = pack_vnni bf16 ([N/16, K/2, 16, 2]); kind 1 = pack_int4 codes with fp16 scale and
 * offset ([N/16, K/gs, 16]); kind 2 = a plain bf16 [N, K] weight (linear_bf16). bias [N] bf16 or NULL; the
 * output is fp32 (unrounded) when y_f32, else bf16. */
typedef struct {
    int64_t kind;
    const void *weight;
    const void *scale;
    const void *offset;
    const bf16 *bias;
    int64_t n;
    int64_t group_size;
    int64_t y_f32;
} decode_matmul;

/* A sparse MoE block: the router's logits (softmax in fp32, the top_k largest, renormalized to sum 1 when
 * `renormalize`), each expert's SwiGLU MLP on the rows routed to it (gate_up[e].n == 2 * inter), summed
 * per row in expert order with the routing weights in fp32; plus, when shared_inter > 0, a shared SwiGLU
 * expert scaled by sigmoid(shared_gate(x)) (one output). Scratch for up to the step's rows: logits
 * [B, E] fp32, ids [B, top_k], weights [B, top_k], members [B], member_weights [B], x_rows [B, H] bf16,
 * gate_up_out [B, 2 * max(inter, shared_inter)] fp32, act_out [B, max(inter, shared_inter)] bf16,
 * expert_out [B, H] fp32, shared_gate_out [B] fp32. */
typedef struct {
    decode_matmul router;
    const decode_matmul *gate_up;
    const decode_matmul *down;
    int64_t num_experts;
    int64_t top_k;
    int64_t renormalize;
    int64_t inter;
    decode_matmul shared_gate_up, shared_down, shared_gate;
    int64_t shared_inter;
    float *logits;
    int64_t *ids;
    float *weights;
    int64_t *members;
    float *member_weights;
    bf16 *x_rows;
    void *gate_up_out;
    bf16 *act_out;
    void *expert_out;
    float *shared_gate_out;
} decode_moe;

/* y [rows, m->n] = x [rows, k] (row stride k) times m's weight; 0, or a kernel's negative error code. */
int64_t decode_matmul_run(const decode_matmul *m, const bf16 *x, int64_t k, void *y, int64_t rows);

/* The block's output for rows x [B, H] (bf16) into out [B, H] fp32; 0 or a matmul's error code. */
int64_t decode_moe_block(const decode_moe *moe, const bf16 *x, int64_t B, int64_t H, float *out);

/* One thread's walk through a decode step (cpu_decode_team.c). team NULL: the kernels run one after
 * another, each in its own OpenMP region (the thread is the only one walking); else every thread of the
 * team walks the same ops, numbered in `op`, sharing the scratch: xf [rows, widest K] fp32 for the AVX2
 * bf16 product's x, rows for the AVX2 4-bit product's, parts for split decode attention's runs. */
typedef struct {
    team *team;
    int64_t op, me;
    float *xf;
    int4_rows rows;
    float *parts; /* split decode attention's states (step_attention) */
} step_worker;

/* 1 when this thread runs the next serial op (then step_serial_done after it); always 1 without a team. */
static inline int step_serial_take(step_worker *w) {
    const int64_t op = w->op++;
    return w->team ? team_serial_begin(w->team, op) : 1;
}

static inline void step_serial_done(step_worker *w) {
    if (w->team) team_serial_end(w->team, w->op - 1);
}

/* decode_matmul_run as a team op (or the kernel alone without a team). */
int64_t step_matmul(step_worker *w, const decode_matmul *m, const bf16 *x, int64_t k, void *y, int64_t rows);

/* paged_decode_attention_bf16 as team ops (the cache write, then (sequence, KV head) items). */
void step_attention(step_worker *w, const bf16 *q, bf16 *out, bf16 *k_cache, bf16 *v_cache,
                    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, const int64_t *slots,
                    const bf16 *k_new, int64_t k_stride, const bf16 *v_new, int64_t v_stride, int64_t B, int64_t H,
                    int64_t KVH, int64_t D, int64_t block_size, int64_t window, float scale, float softcap);

/* The kernels' chunks for the team form of the decode step (cpu_team.h; cpu_decode_team.c): each computes
 * its part from the op's inputs and stores it under `commit` (NULL: at once, as the kernels' own loops). */
void linear_bf16_chunk(const bf16 *x, int64_t x_stride, const bf16 *w, const bf16 *bias, void *y, int64_t y_stride,
                       int64_t M, int64_t N, int64_t K, int64_t y_f32, int64_t n0, int64_t nb, chunk_commit *commit);
void decode_attention_item(const bf16 *q, bf16 *out, const bf16 *k_cache, const bf16 *v_cache,
                           const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, int64_t b, int64_t g,
                           int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t window, float scale,
                           float softcap, chunk_commit *commit);
#if ASERVE_PACKED_AVX2 && !defined(__AVX512BF16__)
/* linear_vnni_avx2: x as fp32 rows (xf [M, K]); chunks of vnni_avx2_chunk_groups(M) column groups of 16. */
float *vnni_avx2_rows(const bf16 *x, int64_t x_stride, int64_t M, int64_t K, float *xf);
int64_t vnni_avx2_chunk_groups(int64_t M);
void vnni_avx2_chunk(const float *xf, const bf16 *w_packed, const bf16 *bias, void *y, int64_t y_stride, int64_t M,
                     int64_t K, int64_t y_f32, int64_t g0, int64_t ng, chunk_commit *commit);
/* linear_int4_avx2: x rounded into r (arrays for M x K); chunks of one column group of 16. */
void int4_avx2_rows(const bf16 *x, int64_t x_stride, int64_t M, int64_t K, int64_t gs, const int4_rows *r);
void int4_avx2_chunk(const int4_rows *r, const uint8_t *q_packed, const uint16_t *d, const uint16_t *m,
                     const bf16 *bias, void *y, int64_t y_stride, int64_t M, int64_t K, int64_t y_f32, int64_t gs,
                     int64_t c0, chunk_commit *commit);
#endif

#endif /* ASERVE_CPU_DECODE_H */
