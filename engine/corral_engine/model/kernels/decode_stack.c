/* A Llama-family decoder stack for a small batch of decodes (one new token per sequence), every
 * layer in one call: the model's forward pass from the token embeddings to the final norm, with
 * no return to Python between ops. At batch 1 the model's own arithmetic is a few milliseconds of
 * memory-bound matmuls; the ~100 Python-level calls per layer around them (module calls, views,
 * ctypes argument checks, tensor allocations) cost ~100 us a layer, a quarter of the step.
 *
 * It runs the same kernels in the same order as the PyTorch-level path does for such a batch (the
 * bf16 ops of fused_ops.c, linear_rows_bf16 for every matmul, paged_decode_bf16, write_kv_bf16),
 * so the result is bit for bit what that path computes; model/decode_stack.py says when it runs.
 *
 * Per layer (R rows, hidden H, NH query and KVH key/value heads of size D, MLP width I):
 *   h, residual = rms_norm(x) and x (first layer) | add_rms_norm(x, residual)
 *   qkv = h Wqkv^T (+ b)                      [R, (NH + 2 KVH) D]
 *   q, k = q_norm(q), k_norm(k)               (Qwen3-style per-head norms, where the model has them)
 *   rotary(q, k); K/V rows into their cache slots; attn = paged_decode(q)
 *   h, residual = add_rms_norm(attn Wo^T (+ b), residual)
 *   x = silu_and_mul(h Wgu^T (+ b)) Wdown^T (+ b)
 * and at the end out = add_rms_norm(x, residual) with the final norm's weight.
 */
#include "amx_linear.c"
#include "fused_ops.c"
#include "paged_decode.c"

typedef struct {
    const uint16_t *input_norm, *post_norm; /* [H] */
    const uint16_t *qkv, *qkv_bias;         /* [(NH + 2 KVH) D, H], [(NH + 2 KVH) D] or NULL */
    const uint16_t *q_norm, *k_norm;        /* [D] each, or both NULL */
    const uint16_t *o, *o_bias;             /* [H, NH D], [H] or NULL */
    const uint16_t *gate_up, *gate_up_bias; /* [2I, H], [2I] or NULL */
    const uint16_t *down, *down_bias;       /* [H, I], [H] or NULL */
    uint16_t *k_cache, *v_cache;            /* [num_slots, KVH D] each */
    int64_t window;                         /* sliding window, 0: none */
} DecodeLayer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t block_size, num_slots;
    float eps, scale;
    const uint16_t *final_norm; /* [H] */
    const DecodeLayer *layers;
} DecodeStack;

/* x [R, H]: the rows' embeddings (left as they are); out [R, H]: the final norm's output. cos and
 * sin [R, D]; slots [R]; block_tables [R, max_blocks]; ctx_lens [R] (context after this step).
 * Returns 0, 1 when a buffer could not be allocated, 2 when a slot is past the cache. */
int decode_stack_bf16(const DecodeStack *m, const uint16_t *x, uint16_t *out, int64_t rows, const uint16_t *cos,
                      const uint16_t *sin, const int64_t *slots, const int64_t *block_tables, int64_t max_blocks,
                      const int64_t *ctx_lens, int num_threads) {
    const int64_t H = m->hidden, NH = m->num_heads, KVH = m->num_kv_heads, D = m->head_dim, I = m->intermediate;
    const int64_t QKV = (NH + 2 * KVH) * D, R = rows;
    const size_t sizes[] = {R * H, R * H, R * H, R * QKV, R * NH * D, R * KVH * D, R * NH * D, R * 2 * I, R * I};
    size_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) total += sizes[i];
    uint16_t *work = malloc(sizeof(uint16_t) * total);
    if (work == NULL) return 1;
    uint16_t *residual = work, *h = residual + R * H, *y = h + R * H, *qkv = y + R * H;
    uint16_t *q = qkv + R * QKV, *k_normed = q + R * NH * D, *attn = k_normed + R * KVH * D;
    uint16_t *gate_up = attn + R * NH * D, *act = gate_up + R * 2 * I;
    int failed = 0;
    for (int64_t l = 0; l < m->num_layers && !failed; l++) {
        const DecodeLayer *L = &m->layers[l];
        const uint16_t *in = l == 0 ? x : y;
        if (l == 0) {
            memcpy(residual, x, sizeof(uint16_t) * R * H);
            rms_norm_bf16(x, L->input_norm, h, R, H, m->eps, num_threads);
        } else {
            add_rms_norm_bf16(in, residual, L->input_norm, h, residual, R, H, m->eps, num_threads);
        }
        failed |= linear_rows_bf16(h, L->qkv, L->qkv_bias, qkv, R, QKV, H, num_threads) != 0;
        uint16_t *qs = qkv, *ks = qkv + NH * D;
        int64_t q_stride = QKV, k_stride = QKV;
        if (L->q_norm != NULL) { /* per head, into q and k_normed (the norm makes new tensors) */
            for (int64_t r = 0; r < R; r++) {
                rms_norm_bf16(qkv + r * QKV, L->q_norm, q + r * NH * D, NH, D, m->eps, num_threads);
                rms_norm_bf16(qkv + r * QKV + NH * D, L->k_norm, k_normed + r * KVH * D, KVH, D, m->eps,
                              num_threads);
            }
            qs = q, ks = k_normed, q_stride = NH * D, k_stride = KVH * D;
        }
        rotary_bf16(qs, ks, cos, sin, R, NH, KVH, D, q_stride, k_stride, D, num_threads);
        if (qs != q)
            for (int64_t r = 0; r < R; r++) memcpy(q + r * NH * D, qs + r * q_stride, sizeof(uint16_t) * NH * D);
        if (write_kv_bf16(ks, qkv + (NH + KVH) * D, k_stride, QKV, L->k_cache, L->v_cache, slots, R, KVH * D,
                          m->num_slots, num_threads)) {
            failed = 2;
            break;
        }
        failed |= paged_decode_bf16(q, L->k_cache, L->v_cache, block_tables, ctx_lens, attn, R, max_blocks,
                                    m->block_size, KVH, NH / KVH, D, m->scale, L->window, num_threads) != 0;
        failed |= linear_rows_bf16(attn, L->o, L->o_bias, y, R, H, NH * D, num_threads) != 0;
        add_rms_norm_bf16(y, residual, L->post_norm, h, residual, R, H, m->eps, num_threads);
        failed |= linear_rows_bf16(h, L->gate_up, L->gate_up_bias, gate_up, R, 2 * I, H, num_threads) != 0;
        silu_and_mul_bf16(gate_up, act, R, I, num_threads);
        failed |= linear_rows_bf16(act, L->down, L->down_bias, y, R, H, I, num_threads) != 0;
    }
    if (!failed) {
        if (m->num_layers == 0)
            rms_norm_bf16(x, m->final_norm, out, R, H, m->eps, num_threads);
        else
            add_rms_norm_bf16(y, residual, m->final_norm, out, residual, R, H, m->eps, num_threads);
    }
    free(work);
    return failed;
}
