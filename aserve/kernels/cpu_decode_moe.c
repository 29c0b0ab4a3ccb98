/* A sparse MoE block of the native decode step (cpu_decode.h's decode_moe): the arithmetic of the layer's
 * CPU form (SparseMoeBlock: select_experts, FusedMoE grouped by expert, the shared expert) within fp32
 * rounding: the routing softmax uses libm's expf where torch uses its own, and the C path is checked
 * against the layers to a tolerance (tests/runner/test_cpu_decode_step.py). */
#include "cpu_decode.h"

static inline float load_f(const void *p, int64_t is_f32, int64_t i) {
    return is_f32 ? ((const float *)p)[i] : bf16_to_f32(((const bf16 *)p)[i]);
}

/* Each row's top_k experts by probability (ties: the lower id first) and their weights. */
static void route(const decode_moe *M, int64_t B) {
    const int64_t E = M->num_experts, k = M->top_k;
    for (int64_t b = 0; b < B; b++) {
        float p[E];
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            p[e] = load_f(M->logits, M->router.y_f32, b * E + e);
            mx = p[e] > mx ? p[e] : mx;
        }
        for (int64_t e = 0; e < E; e++) {
            p[e] = expf(p[e] - mx);
            sum += p[e];
        }
        float picked = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
            M->ids[b * k + j] = best;
            M->weights[b * k + j] = p[best] / sum;
            picked += M->weights[b * k + j];
            p[best] = -1.0f; /* taken */
        }
        if (M->renormalize)
            for (int64_t j = 0; j < k; j++) M->weights[b * k + j] /= picked;
    }
}

/* out[row] += w * y[i] for each member row, fp32, the product rounded before the sum (as torch's mul_ then
 * index_add_; no contraction into one fma). */
__attribute__((optimize("fp-contract=off"))) static void scatter_add(float *out, const void *y, int64_t y_f32,
                                                                     const int64_t *rows, const float *w, int64_t n,
                                                                     int64_t H) {
    for (int64_t i = 0; i < n; i++) {
        float *o = out + rows[i] * H;
        for (int64_t h = 0; h < H; h++) {
            const float prod = w[i] * load_f(y, y_f32, i * H + h);
            o[h] = o[h] + prod;
        }
    }
}

static int64_t swiglu(const decode_matmul *gate_up, const decode_matmul *down, const decode_moe *M, const bf16 *x,
                      int64_t rows, int64_t H, int64_t inter) {
    int64_t status;
    if ((status = decode_matmul_run(gate_up, x, H, M->gate_up_out, rows))) return status;
    silu_and_mul_bf16(M->gate_up_out, 2 * inter, gate_up->y_f32, M->act_out, rows, inter);
    return decode_matmul_run(down, M->act_out, inter, M->expert_out, rows);
}

int64_t decode_moe_block(const decode_moe *M, const bf16 *x, int64_t B, int64_t H, float *out) {
    int64_t status;
    if ((status = decode_matmul_run(&M->router, x, H, M->logits, B))) return status;
    route(M, B);
    memset(out, 0, (size_t)(B * H) * sizeof(float));
    const int64_t k = M->top_k;
    for (int64_t e = 0; e < M->num_experts; e++) { /* the rows routed to e, in row order */
        int64_t n = 0;
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < k; j++)
                if (M->ids[b * k + j] == e) {
                    M->members[n] = b;
                    M->member_weights[n] = M->weights[b * k + j];
                    memcpy(M->x_rows + n * H, x + b * H, (size_t)H * sizeof(bf16));
                    n++;
                }
        if (!n) continue;
        if ((status = swiglu(M->gate_up + e, M->down + e, M, M->x_rows, n, H, M->inter))) return status;
        scatter_add(out, M->expert_out, M->down[e].y_f32, M->members, M->member_weights, n, H);
    }
    if (M->shared_inter > 0) { /* out += sigmoid(gate(x)) * shared(x), the gate rounded to bf16 as the layer's */
        if ((status = swiglu(&M->shared_gate_up, &M->shared_down, M, x, B, H, M->shared_inter))) return status;
        if ((status = decode_matmul_run(&M->shared_gate, x, H, M->shared_gate_out, B))) return status;
        for (int64_t b = 0; b < B; b++) {
            const float g = load_f(M->shared_gate_out, M->shared_gate.y_f32, b);
            M->members[b] = b;
            M->member_weights[b] = bf16_to_f32(f32_to_bf16(1.0f / (1.0f + expf(-g))));
        }
        scatter_add(out, M->expert_out, M->shared_down.y_f32, M->members, M->member_weights, B, H);
    }
    return 0;
}
