#ifndef ASERVE_CPU_DECODE_H
#define ASERVE_CPU_DECODE_H

/* The structs of the native decode step (cpu_decode_step.c, cpu_decode_moe.c); filled by
 * aserve/runner/cpu_decode_layers.py (ctypes Structures with the same fields in the same order). */
#include "cpu_common.h"

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

#endif /* ASERVE_CPU_DECODE_H */
