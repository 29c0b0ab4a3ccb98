/* The decoder layers of a bf16 decode step in one call: for every layer, the residual add and norm, the
 * fused q|k|v projection, rotary, the new K/V written into the paged cache and decode attention, o_proj,
 * the residual add and norm, the MLP (gated, plain or a sparse MoE block), with no Python between the ops.
 * It calls the kernels the layers call one by one (cpu_ops.c, cpu_matmul.c) in the same order with the
 * same roundings, so for the RMSNorm families its result is bitwise the layer-by-layer one; LayerNorm
 * families (GPT-2, OPT) and MoE blocks agree with theirs within rounding (their torch forms compute the
 * norm and the routing themselves). Built with them by cpu_ops.py; the caller
 * (aserve/runner/cpu_decode_step.py) checks every shape and layout, this code trusts them. */
#include "cpu_decode.h"

/* One decoder layer. Pre-norm form (post_ln == 0, gemma == 0; Llama, GPT-2, OPT): x -> norm(x + res) ->
 * attention -> o -> norm(o + res) -> MLP. Gemma form (gemma == 1): the attention output is normalized alone
 * (post_norm), added to the residual in pre_ff_norm, and the MLP output is normalized alone (post_ff_norm)
 * before the next layer adds it. Post-norm form (post_ln == 1, OPT-350m): h = norm(attention(x) + x) with
 * input_norm, out = norm(MLP(h) + h) with post_norm; no separate residual stream.
 * Norms: RMSNorm scaling by norm_offset + w, or (layer_norm) LayerNorm with weight and bias (each may be
 * NULL); per-head q / k norms [D] (NULL: none). The MLP: `moe` when not NULL, else gate_up (act
 * ACT_SILU_AND_MUL / ACT_GELU_TANH_AND_MUL: gate|up, n = 2I) or fc1 (ACT_GELU_TANH / ACT_RELU / ACT_GELU:
 * n = I), then down. The cache halves [num_blocks, block_size, KVH, D], the window (0: none), score scale
 * and softcap (0: none), rotary (0: none, positions were embedded) and which table (1: the local one). */
typedef struct {
    const bf16 *input_norm;
    const bf16 *post_norm;
    const bf16 *pre_ff_norm;
    const bf16 *post_ff_norm;
    const bf16 *q_norm;
    const bf16 *k_norm;
    const bf16 *input_norm_bias;
    const bf16 *post_norm_bias;
    decode_matmul qkv, o, gate_up, down;
    const decode_moe *moe;
    bf16 *k_cache;
    bf16 *v_cache;
    int64_t window;
    float scale;
    float softcap;
    float norm_offset;
    int64_t gemma;
    int64_t act;
    int64_t local_rotary;
    int64_t rotary;
    int64_t layer_norm;
    int64_t post_ln;
} decode_layer;

/* The shapes and scratch every layer shares (see decode_layers_bf16). */
typedef struct {
    int64_t B, H, NH, KVH, D, block_size, rot_half, bt_stride;
    float eps;
    const bf16 *cos_sin, *local_cos_sin;
    const int32_t *block_tables, *seq_lens;
    const int64_t *slots;
    bf16 *normed, *qkv, *q_rot, *k_rot, *attn, *act, *q_normed, *k_normed, *attn_normed;
    void *o_out, *gate_up;
} step_ctx;

int64_t decode_matmul_run(const decode_matmul *m, const bf16 *x, int64_t k, void *y, int64_t rows) {
    if (m->kind == 0)
        return linear_vnni_bf16(x, k, (const bf16 *)m->weight, m->bias, y, m->n, rows, m->n, k, m->y_f32);
    if (m->kind == 2) {
        linear_bf16(x, k, (const bf16 *)m->weight, m->bias, y, m->n, rows, m->n, k, m->y_f32);
        return 0;
    }
    return linear_int4_bf16(x, k, (const uint8_t *)m->weight, (const uint16_t *)m->scale, (const uint16_t *)m->offset,
                            m->bias, y, m->n, rows, m->n, k, m->y_f32, m->group_size);
}

/* A serial op (cpu_decode_team.c): the norm on the thread that takes it. */
static void norm(step_worker *sw, const decode_layer *L, const bf16 *w, const bf16 *bias, const void *x,
                 int64_t x_f32, const void *res, int64_t res_f32, bf16 *out, float *sum_out, const step_ctx *c) {
    if (!step_serial_take(sw)) return;
    if (L->layer_norm)
        add_layer_norm_bf16(x, c->H, x_f32, res, c->H, res_f32, w, bias, out, sum_out, c->B, c->H, c->eps);
    else
        add_rms_norm_bf16(x, c->H, x_f32, res, c->H, res_f32, w, out, sum_out, c->B, c->H, c->eps, L->norm_offset);
    step_serial_done(sw);
}

/* attention(x) -> c->o_out (o's output dtype): q|k|v, q/k norms, rotary, cache write and decode attention. */
static int64_t attention(step_worker *sw, const decode_layer *L, const bf16 *x, const step_ctx *c) {
    const int64_t B = c->B, NH = c->NH, KVH = c->KVH, D = c->D, width = (NH + 2 * KVH) * D;
    int64_t status;
    if ((status = step_matmul(sw, &L->qkv, x, c->H, c->qkv, B))) return status;
    const bf16 *rot = L->local_rotary ? c->local_cos_sin : c->cos_sin;
    const bf16 *k = c->k_rot;
    int64_t k_stride = KVH * D;
    const int run = step_serial_take(sw); /* the norms, rotary or copy: one serial op */
    if (L->q_norm && run) { /* each head of q and k normalized over D, token by token (rows of D, stride D) */
        for (int64_t b = 0; b < B; b++) {
            add_rms_norm_bf16(c->qkv + b * width, D, 0, NULL, 0, 0, L->q_norm, c->q_normed + b * NH * D, NULL, NH, D,
                              c->eps, L->norm_offset);
            add_rms_norm_bf16(c->qkv + b * width + NH * D, D, 0, NULL, 0, 0, L->k_norm, c->k_normed + b * KVH * D,
                              NULL, KVH, D, c->eps, L->norm_offset);
        }
        rotary_neox_bf16(c->q_normed, NH * D, c->k_normed, KVH * D, rot, c->q_rot, c->k_rot, B, NH, KVH, D,
                         c->rot_half);
    } else if (L->rotary && !L->q_norm) {
        if (run)
            rotary_neox_bf16(c->qkv, width, c->qkv + NH * D, width, rot, c->q_rot, c->k_rot, B, NH, KVH, D,
                             c->rot_half);
    } else if (!L->q_norm) { /* learned positions: q as it is (made contiguous), k read in place */
        if (run)
            for (int64_t b = 0; b < B; b++)
                memcpy(c->q_rot + b * NH * D, c->qkv + b * width, (size_t)(NH * D) * sizeof(bf16));
        k = c->qkv + NH * D;
        k_stride = width;
    }
    if (run) step_serial_done(sw);
    step_attention(sw, c->q_rot, c->attn, L->k_cache, L->v_cache, c->block_tables, c->bt_stride, c->seq_lens, c->slots,
                   k, k_stride, c->qkv + (NH + KVH) * D, width, B, NH, KVH, D, c->block_size, L->window, L->scale,
                   L->softcap);
    return step_matmul(sw, &L->o, c->attn, NH * D, c->o_out, B);
}

/* MLP(x) -> out (fp32 when *out_f32 is set on return, else bf16). */
static int64_t mlp(step_worker *sw, const decode_layer *L, const bf16 *x, void *out, int64_t *out_f32,
                   const step_ctx *c) {
    int64_t status;
    if (L->moe) { /* (never in a team: decode_layers_bf16 leaves MoE models on per-kernel regions) */
        *out_f32 = 1;
        return decode_moe_block(L->moe, x, c->B, c->H, (float *)out);
    }
    if ((status = step_matmul(sw, &L->gate_up, x, c->H, c->gate_up, c->B))) return status;
    const int64_t gated = L->act == ACT_SILU_AND_MUL || L->act == ACT_GELU_TANH_AND_MUL;
    const int64_t inter = gated ? L->gate_up.n / 2 : L->gate_up.n;
    if (step_serial_take(sw)) {
        if (L->act == ACT_SILU_AND_MUL) silu_and_mul_bf16(c->gate_up, 2 * inter, L->gate_up.y_f32, c->act, c->B, inter);
        else if (L->act == ACT_GELU_TANH_AND_MUL)
            gelu_tanh_and_mul_bf16(c->gate_up, 2 * inter, L->gate_up.y_f32, c->act, c->B, inter);
        else act_bf16(c->gate_up, inter, L->gate_up.y_f32, c->act, c->B, inter, L->act);
        step_serial_done(sw);
    }
    *out_f32 = L->down.y_f32;
    return step_matmul(sw, &L->down, c->act, inter, out, c->B);
}

/* The layers on one thread's walk (step_worker): every thread of a team runs this with the same arguments. */
static int64_t run_layers(step_worker *sw, const decode_layer *layers, int64_t num_layers, const bf16 *embedded,
                          void *hidden, float *residual0, float *residual1, const step_ctx *cp) {
    const step_ctx c = *cp;
    bf16 *normed = c.normed, *attn_normed = c.attn_normed;
    void *o_out = c.o_out;
    float *residual[2] = {residual0, residual1};
    int64_t cur = 0;          /* residual[cur] holds the stream once the first layer's second norm ran */
    int64_t hidden_f32 = 0;   /* the dtype the previous layer left its output in */
    int64_t status, f32;
    for (int64_t l = 0; l < num_layers; l++) {
        const decode_layer *L = layers + l;
        if (L->post_ln) { /* the stream is each layer's normed output (bf16) */
            const bf16 *x = l == 0 ? embedded : (const bf16 *)hidden;
            if ((status = attention(sw, L, x, &c))) return status;
            norm(sw, L, L->input_norm, L->input_norm_bias, o_out, L->o.y_f32, x, 0, normed, residual0, &c);
            if ((status = mlp(sw, L, normed, o_out, &f32, &c))) return status;
            norm(sw, L, L->post_norm, L->post_norm_bias, o_out, f32, normed, 0, (bf16 *)hidden, residual1, &c);
            hidden_f32 = 0;
            continue;
        }
        if (l == 0) { /* the stream starts as the embedding (bf16); the norm takes it as x */
            norm(sw, L, L->input_norm, L->input_norm_bias, embedded, 0, NULL, 0, normed, NULL, &c);
        } else {
            norm(sw, L, L->input_norm, L->input_norm_bias, hidden, hidden_f32, residual[cur], 1, normed,
                 residual[1 - cur], &c);
            cur = 1 - cur;
        }
        if ((status = attention(sw, L, normed, &c))) return status;
        const void *stream_x = o_out; /* what the second norm adds to the residual */
        int64_t stream_f32 = L->o.y_f32;
        const bf16 *second_norm = L->post_norm;
        if (L->gemma) { /* the attention output normalized alone, then added in pre_ff_norm */
            norm(sw, L, L->post_norm, NULL, o_out, L->o.y_f32, NULL, 0, attn_normed, NULL, &c);
            stream_x = attn_normed;
            stream_f32 = 0;
            second_norm = L->pre_ff_norm;
        }
        if (l == 0) {
            norm(sw, L, second_norm, L->post_norm_bias, stream_x, stream_f32, embedded, 0, normed, residual[cur], &c);
        } else {
            norm(sw, L, second_norm, L->post_norm_bias, stream_x, stream_f32, residual[cur], 1, normed,
                 residual[1 - cur], &c);
            cur = 1 - cur;
        }
        if (L->gemma) { /* the MLP output normalized alone: the layer's output (bf16) */
            if ((status = mlp(sw, L, normed, o_out, &f32, &c))) return status;
            norm(sw, L, L->post_ff_norm, NULL, o_out, f32, NULL, 0, (bf16 *)hidden, NULL, &c);
            hidden_f32 = 0;
        } else {
            if ((status = mlp(sw, L, normed, hidden, &hidden_f32, &c))) return status;
        }
    }
    return cur | (hidden_f32 << 1);
}

#define TEAM_OPS_PER_LAYER 24 /* at most 19 (a Gemma layer with q / k norms and split attention) */

/* The widest input any projection takes (the scratch rows' width) and the most chunks any op cuts into;
 * 0 when a layer keeps the step off a team (an MoE block; on AVX512-BF16 builds, whose kernels have no
 * chunk forms yet, every layer). */
static int64_t team_sizes(const decode_layer *layers, int64_t num_layers, const step_ctx *c, int64_t *max_k,
                          int64_t *max_chunks) {
#if defined(__AVX512BF16__)
    (void)layers; (void)num_layers; (void)c; (void)max_k; (void)max_chunks;
    return 0;
#else
    *max_k = c->H > c->NH * c->D ? c->H : c->NH * c->D;
    *max_chunks = c->B * c->KVH;
#if ASERVE_ATTEND_AVX2 /* split decode attention: B KVH S < ATTEND_SPLIT_ITEMS + B KVH items (attend_avx2_splits) */
    if (c->B * c->KVH < ATTEND_SPLIT_ITEMS) *max_chunks = 2 * ATTEND_SPLIT_ITEMS;
#endif
    for (int64_t l = 0; l < num_layers; l++) {
        const decode_layer *L = layers + l;
        if (L->moe) return 0;
        const decode_matmul *ms[4] = {&L->qkv, &L->o, &L->gate_up, &L->down};
        for (int64_t i = 0; i < 4; i++) {
            if (ms[i]->kind != 2 && !ASERVE_PACKED_AVX2) return 0;
            const int64_t chunks = ms[i]->kind == 2 ? (ms[i]->n + 3) / 4 : ms[i]->n / 16;
            *max_chunks = chunks > *max_chunks ? chunks : *max_chunks;
        }
        const int64_t inter = L->act == ACT_SILU_AND_MUL || L->act == ACT_GELU_TANH_AND_MUL ? L->gate_up.n / 2
                                                                                           : L->gate_up.n;
        *max_k = inter > *max_k ? inter : *max_k;
    }
    return 1;
#endif
}

/* B decode rows through `num_layers` layers. embedded [B, H] bf16 (the embedding's output: scaled, with
 * positions added, where the model does so) -> the last layer's output in hidden (fp32 [B, H] when the
 * return's bit 1 (value 2) is set, else bf16) and, for the pre-norm forms, the residual stream [B, H] fp32 in
 * residual[r] for r = the return's bit 0 (negative: a matmul's error code). cos_sin / local_cos_sin
 * [B, 2 * rot_half] bf16 rows; block_tables [B, bt_stride] int32, seq_lens [B] int32 (after this token),
 * slots [B] int64. Scratch: normed [B, H], qkv [B, (NH + 2 KVH) D], q_rot and q_normed [B, NH, D], k_rot and
 * k_normed [B, KVH, D], attn [B, NH, D] (bf16); o_out [B, H], gate_up [B, the widest first MLP projection]
 * (fp32 or bf16); act [B, I] (bf16); attn_normed [B, H] (bf16). With team_threads >= 2 (at most
 * TEAM_MAX_THREADS; no MoE block; not on AVX512-BF16 builds yet), the whole step is one OpenMP region of
 * that many threads sharing the ops as cpu_team.h describes (the same results bit for bit); else each
 * kernel runs in its own region. */
int64_t decode_layers_bf16(const decode_layer *layers, int64_t num_layers, const bf16 *embedded, void *hidden,
                           float *residual0, float *residual1, const bf16 *cos_sin, const bf16 *local_cos_sin,
                           int64_t rot_half, const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                           const int64_t *slots, int64_t B, int64_t H, int64_t NH, int64_t KVH, int64_t D,
                           int64_t block_size, float eps, bf16 *normed, bf16 *qkv, bf16 *q_rot, bf16 *k_rot,
                           bf16 *attn, void *o_out, void *gate_up, bf16 *act, bf16 *q_normed, bf16 *k_normed,
                           bf16 *attn_normed, int64_t team_threads) {
    const step_ctx c = {B, H, NH, KVH, D, block_size, rot_half, bt_stride, eps, cos_sin, local_cos_sin,
                        block_tables, seq_lens, slots, normed, qkv, q_rot, k_rot, attn, act, q_normed, k_normed,
                        attn_normed, o_out, gate_up};
    step_worker alone = {NULL, 0, 0, NULL, {NULL, NULL, NULL, NULL}, NULL};
    const int64_t threads = team_threads;
    int64_t max_k = 0, max_chunks = 0;
    if (threads < 2 || threads > TEAM_MAX_THREADS ||
        !team_sizes(layers, num_layers, &c, &max_k, &max_chunks))
        return run_layers(&alone, layers, num_layers, embedded, hidden, residual0, residual1, &c);
    team t;
    const size_t cells = (size_t)(B * max_k), round = 64;
    const size_t xf_bytes = (cells * sizeof(float) + round - 1) / round * round, codes = (cells + round - 1) / round * round;
    const size_t sums = ((cells / 32 + 1) * sizeof(float) + round - 1) / round * round;
    const size_t parts = (size_t)(2 * ATTEND_SPLIT_ITEMS * (NH * D / KVH + 2 * NH / KVH)) * sizeof(float);
    char *scratch = aligned_alloc(round, xf_bytes + 2 * codes + 2 * sums + parts);
    if (!scratch || team_init(&t, num_layers * TEAM_OPS_PER_LAYER + 4, max_chunks, threads)) {
        free(scratch);
        return -2;
    }
    float *xf = (float *)scratch; /* then the 4-bit product's xh, xl, xs, xsum */
    const int4_rows rows = {(int8_t *)(scratch + xf_bytes), (int8_t *)(scratch + xf_bytes + codes),
                            (float *)(scratch + xf_bytes + 2 * codes), (float *)(scratch + xf_bytes + 2 * codes + sums)};
    int64_t result = 0;
#pragma omp parallel num_threads(threads)
    {
        step_worker w = {&t, 0, omp_get_thread_num(), xf, rows, (float *)(scratch + xf_bytes + 2 * codes + 2 * sums)};
        const int64_t r = run_layers(&w, layers, num_layers, embedded, hidden, residual0, residual1, &c);
        if (w.me == 0) result = r;
    }
    team_free(&t);
    free(scratch);
    return result;
}
