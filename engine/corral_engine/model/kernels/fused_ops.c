/* Fused elementwise ops for bfloat16 activations on the CPU: one pass over memory instead of the
 * four to six PyTorch makes (float32 round trips, separate multiplies); and a matmul for the few
 * rows of a small decode batch on CPUs without native bf16 (linear_rows_bf16); the sampler's
 * exponential race, on probabilities or on logits (exponential_race_f32, _logits_f32), and its
 * greedy picks (argmax_rows_f32); prompt
 * attention's masked softmax (causal_softmax_bf16); and the KV cache write (write_kv_bf16, at the
 * end).
 *
 * Each reproduces the rounding of the PyTorch expression it replaces, step by step:
 *   silu_and_mul:  bf16(bf16(silu(gate)) * up)                       x = [T, 2I] -> out [T, I]
 *   rms_norm:      bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))         x, out [T, H]; w [H]
 *   add_rms_norm:  s = bf16(x + residual), then rms_norm(s)           also writes s
 *   rotary:        bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))   q and k heads, in place
 *   causal_softmax: softmax(bf16(scores * scale)) over a row's visible columns, in place
 * where every intermediate is computed in float32, as PyTorch does for bf16 tensors. Rows run in
 * parallel (OpenMP, torch's thread count) when there are enough of them to pay for waking the
 * workers. Built with -O3 -march=native -ffast-math.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* Below this many rows a loop runs on the calling thread: a decode step at batch 1 does a few
 * hundred of these calls, and waking OpenMP's workers costs more than a row's work. */
#define PARALLEL_MIN_ROWS 16

int silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t num_rows, int64_t size, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows >= PARALLEL_MIN_ROWS)
    for (int64_t r = 0; r < num_rows; r++) {
        const uint16_t *gate = x + r * 2 * size, *up = gate + size;
        uint16_t *o = out + r * size;
        for (int64_t i = 0; i < size; i++) {
            const float g = bf16_to_f32(gate[i]);
            const float s = round_bf16(g / (1.0f + expf(-g)));
            o[i] = f32_to_bf16(s * bf16_to_f32(up[i]));
        }
    }
    return 0;
}

static inline void rms_norm_row(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t size,
                                float eps) {
    float sum = 0.0f;
    for (int64_t i = 0; i < size; i++) {
        const float v = bf16_to_f32(x[i]);
        sum += v * v;
    }
    const float inv = 1.0f / sqrtf(sum / (float)size + eps);
    for (int64_t i = 0; i < size; i++) {
        const float normed = round_bf16(bf16_to_f32(x[i]) * inv);
        out[i] = f32_to_bf16(bf16_to_f32(weight[i]) * normed);
    }
}

int rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t num_rows, int64_t size,
                  float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows >= PARALLEL_MIN_ROWS)
    for (int64_t r = 0; r < num_rows; r++) {
        rms_norm_row(x + r * size, weight, out + r * size, size, eps);
    }
    return 0;
}

int add_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *out,
                      uint16_t *summed, int64_t num_rows, int64_t size, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows >= PARALLEL_MIN_ROWS)
    for (int64_t r = 0; r < num_rows; r++) {
        const uint16_t *xr = x + r * size, *rr = residual + r * size;
        uint16_t *sr = summed + r * size;
        for (int64_t i = 0; i < size; i++) sr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(rr[i]));
        rms_norm_row(sr, weight, out + r * size, size, eps);
    }
    return 0;
}

/* x[0:half] and x[half:D] of one head: (a, b) -> (a cos - b sin, b cos + a sin), each product and
 * the sum rounded as `x * cos + cat(-x[half:], x[:half]) * sin` rounds them (negation is exact). */
static inline void rotate_head(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[i + half]);
        const float lo = round_bf16(a * bf16_to_f32(cos[i])) - round_bf16(b * bf16_to_f32(sin[i]));
        const float hi = round_bf16(b * bf16_to_f32(cos[i + half])) + round_bf16(a * bf16_to_f32(sin[i + half]));
        x[i] = f32_to_bf16(lo);
        x[i + half] = f32_to_bf16(hi);
    }
}

/* q [T, H, D] and k [T, KVH, D], heads contiguous within a token (rows of the fused QKV output
 * are fine: any token stride); cos and sin [T, D] with a token stride of their own. */
int rotary_bf16(uint16_t *q, uint16_t *k, const uint16_t *cos, const uint16_t *sin, int64_t num_tokens,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t q_stride, int64_t k_stride,
                int64_t cs_stride, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const uint16_t *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        for (int64_t h = 0; h < num_heads; h++) rotate_head(q + t * q_stride + h * head_dim, c, s, half);
        for (int64_t h = 0; h < num_kv_heads; h++) rotate_head(k + t * k_stride + h * head_dim, c, s, half);
    }
    return 0;
}

/* out[r, :] = bf16(x[r, :] w^T + bias) for the few rows of a small batch: x [R, K], w [N, K]
 * (a Linear's weight), bias [N] or NULL, out [R, N]. Columns are split over the threads; each
 * column's weight row is read from memory once for all the rows. Sums are float32, in the
 * kernel's order, rounded to bf16 once, as PyTorch's bf16 matmul accumulates and rounds.
 *
 * Where the CPU multiplies bf16 natively (AVX512-BF16: vdpbf16ps), 32 products per instruction
 * straight from the bf16 values, the weight stream prefetched: a batch of up to 8 rows costs what
 * reading the weight costs (170 MB of weights: 0.8-0.9x oneDNN's time at 1, 4 and 8 rows), and it
 * skips oneDNN's per-call set-up (model/decode_stack.py runs small decode batches through it).
 * With AVX2 and FMA, each 8 weights are widened to float32 once for up to 8 rows and summed
 * 8-wide (two accumulators a row up to 4 rows, so a row's FMA chain does not wait on its own
 * latency), the weight stream prefetched: AVX2 code on a Zen 5, 24 weights of [4608, 768], 0.81-0.88x
 * the time of the loop before at 1-2 rows, 0.55x at 4, 0.64x at 7. PyTorch's bf16 matmul there
 * converts in a slow generic path (1.3x at 1 row to 2.1x at 8 that loop's time, small preset).
 * Anywhere else, a plain loop the compiler vectorises. */

/* How far ahead of the loads the weight stream is prefetched. Without it, from 3 rows on the
 * accumulator chains fill the out-of-order window and fewer weight loads are in flight: a 3-row
 * batch took twice the time of a 2-row one (AVX512-BF16). 2-8 KB measured alike (Zen 5). */
#define PREFETCH_BYTES 4096
#define LR_MAX_ROWS 8 /* rows per pass over a weight row */
#if defined(__AVX512BF16__)
#include <immintrin.h>

typedef uint16_t lr_row_t; /* the dot product reads the rows as given (bf16) */

/* Rows [0, R) of x against weight row wj; R is a compile-time constant in each caller, so the
 * accumulators stay in registers. The tail of K is read through a mask (zeros add nothing). */
static inline __attribute__((always_inline)) void dot_rows(const uint16_t *x, const uint16_t *wj, int64_t k,
                                                           float *sums, const int R) {
    __m512 acc[LR_MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        _mm_prefetch((const char *)(wj + i) + PREFETCH_BYTES, _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wj + i);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(x + r * k + i), wv);
    }
    if (i < k) {
        const __mmask32 m = (__mmask32)((1u << (k - i)) - 1u);
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, wj + i);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * k + i), wv);
    }
    for (int r = 0; r < R; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

typedef float lr_row_t; /* the rows widened to float32 once per call */

/* 8 bf16 values widened to float32 (a bf16 is the top half of a float32). */
static inline __m256 load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* Rows [0, R) of x against weight row wj, each 8 weights widened once for all rows. Up to 4 rows:
 * two accumulators a row (alternate 8-wide chunks), so one row's FMA chain does not wait on its
 * own latency; more rows give the core enough independent chains. */
static inline __attribute__((always_inline)) void dot_rows(const float *x, const uint16_t *wj, int64_t k,
                                                           float *sums, const int R) {
    const int two = R <= 4;
    __m256 acc[LR_MAX_ROWS], acc2[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int r = 0; r < 4; r++) acc2[r] = _mm256_setzero_ps();
    int64_t i = 0;
    if (two) {
        for (; i + 16 <= k; i += 16) {
            if ((i & 31) == 0) _mm_prefetch((const char *)(wj + i) + PREFETCH_BYTES, _MM_HINT_T0);
            const __m256 w0 = load_bf16x8(wj + i), w1 = load_bf16x8(wj + i + 8);
            for (int r = 0; r < R && r < 4; r++) {
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i), w0, acc[r]);
                acc2[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i + 8), w1, acc2[r]);
            }
        }
    }
    for (; i + 8 <= k; i += 8) {
        if ((i & 31) == 0) _mm_prefetch((const char *)(wj + i) + PREFETCH_BYTES, _MM_HINT_T0);
        const __m256 wv = load_bf16x8(wj + i);
        for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i), wv, acc[r]);
    }
    for (int r = 0; r < R; r++) {
        float s = hsum8(two && r < 4 ? _mm256_add_ps(acc[r], acc2[r]) : acc[r]);
        for (int64_t t = i; t < k; t++) s += x[r * k + t] * bf16_to_f32(wj[t]);
        sums[r] = s;
    }
}
#else
typedef float lr_row_t;

static inline __attribute__((always_inline)) void dot_rows(const float *x, const uint16_t *wj, int64_t k,
                                                           float *sums, const int R) {
    for (int r = 0; r < R; r++) {
        float sum = 0.0f;
        for (int64_t i = 0; i < k; i++) sum += x[r * k + i] * bf16_to_f32(wj[i]);
        sums[r] = sum;
    }
}
#endif

int linear_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t rows,
                     int64_t n, int64_t k, int num_threads) {
    lr_row_t *widened = NULL;
    const lr_row_t *xs = (const lr_row_t *)x;
    if (sizeof(lr_row_t) != sizeof(uint16_t)) {
        widened = malloc((size_t)(rows * k) * sizeof(lr_row_t));
        if (widened == NULL) return 1;
        for (int64_t i = 0; i < rows * k; i++) widened[i] = (lr_row_t)bf16_to_f32(x[i]);
        xs = widened;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *wj = w + j * k;
        const float b = bias == NULL ? 0.0f : bf16_to_f32(bias[j]);
        for (int64_t r0 = 0; r0 < rows; r0 += LR_MAX_ROWS) {
            const int64_t left = rows - r0, count = left < LR_MAX_ROWS ? left : LR_MAX_ROWS;
            const lr_row_t *xr = xs + r0 * k;
            float sums[LR_MAX_ROWS];
            switch (count) { /* a constant row count each, so each gets its own register-held loop */
                case 1: dot_rows(xr, wj, k, sums, 1); break;
                case 2: dot_rows(xr, wj, k, sums, 2); break;
                case 3: dot_rows(xr, wj, k, sums, 3); break;
                case 4: dot_rows(xr, wj, k, sums, 4); break;
                case 5: dot_rows(xr, wj, k, sums, 5); break;
                case 6: dot_rows(xr, wj, k, sums, 6); break;
                case 7: dot_rows(xr, wj, k, sums, 7); break;
                default: dot_rows(xr, wj, k, sums, 8); break;
            }
            for (int64_t r = 0; r < count; r++) out[(r0 + r) * n + j] = f32_to_bf16(sums[r] + b);
        }
    }
    free(widened);
    return 0;
}

/* The exponential race of the sampler: token = argmax_v p[v] / E[v] with E[v] ~ Exp(1) draws v with
 * probability p[v] / sum(p) (p need not be normalised). PyTorch's exponential_ draws serially from
 * one generator, ~15 ns a value (20 ms a step for 40 rows of a 32k vocabulary); here each row's
 * noise is a counter-based stream, SplitMix64(row seed + v), so rows run in parallel, the loop
 * vectorises, and a row's draw depends on its seed alone (not on what shares the batch). */
static inline uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* -log(u) for u in (0, 1): exponent plus 2 atanh((m - 1) / (m + 1)) for the mantissa m in [1, 2),
 * five terms (error < 2e-6), written so the compiler vectorises it (libm's logf does not). */
static inline float neg_log(float u) {
    uint32_t bits;
    memcpy(&bits, &u, sizeof bits);
    const float e = (float)((int32_t)(bits >> 23) - 127);
    bits = (bits & 0x007fffffu) | 0x3f800000u;
    float m;
    memcpy(&m, &bits, sizeof m);
    const float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
    const float log_m = s * (2.0f + s2 * (0.6666667f + s2 * (0.4f + s2 * (0.2857143f + s2 * 0.2222222f))));
    return -(e * 0.69314718f + log_m);
}

#define RACE_CHUNK 512

/* One row's race: the argmax over v of w[v] / E_v, E_v = -log(u_v) from the row's noise stream.
 * w[v] is the (unnormalised) probability, or with `from_logits` a logit x turned into
 * exp(x / t - m) (m = max(x) / t: softmax(x / t) up to its row constant, which the argmax does not
 * see), a -inf logit (a masked token) scoring 0, tested on its bits since the build's -ffast-math
 * assumes finite floats. Inlined with a constant `from_logits`, each caller gets its own loop. */
static inline int64_t race_row(const float *w, uint64_t seed, int64_t vocab, int from_logits, float t, float m) {
    const uint64_t base = splitmix64(seed);
    float score[RACE_CHUNK];
    float best = -1.0f;
    int64_t best_v = 0;
    for (int64_t start = 0; start < vocab; start += RACE_CHUNK) {
        const int64_t n = vocab - start < RACE_CHUNK ? vocab - start : RACE_CHUNK;
        for (int64_t i = 0; i < n; i++) {
            const uint64_t bits = splitmix64(base + (uint64_t)(start + i));
            const float u = ((float)(bits >> 40) + 0.5f) * (1.0f / 16777216.0f); /* (0, 1), 24 bits */
            float p = w[start + i];
            if (from_logits) {
                uint32_t xb;
                memcpy(&xb, &w[start + i], sizeof xb);
                p = xb == 0xff800000u ? 0.0f : expf(p / t - m);
            }
            score[i] = p / neg_log(u);
        }
        for (int64_t i = 0; i < n; i++) {
            if (score[i] > best) {
                best = score[i];
                best_v = start + i;
            }
        }
    }
    return best_v;
}

int exponential_race_f32(const float *probs, const uint64_t *seeds, int64_t *out, int64_t num_rows, int64_t vocab,
                         int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows >= 2)
    for (int64_t r = 0; r < num_rows; r++) {
        out[r] = race_row(probs + r * vocab, seeds[r], vocab, 0, 1.0f, 0.0f);
    }
    return 0;
}

/* The same race read straight from logits, for rows sampled at a temperature alone (no top-k,
 * top-p or min-p): no probability tensor is written and read back, and the noise is the probs
 * version's, draw for draw. */
int exponential_race_logits_f32(const float *logits, const float *temps, const uint64_t *seeds, int64_t *out,
                                int64_t num_rows, int64_t vocab, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows >= 2)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *x = logits + r * vocab;
        float top = -FLT_MAX;
        for (int64_t v = 0; v < vocab; v++) {
            top = x[v] > top ? x[v] : top;
        }
        out[r] = race_row(x, seeds[r], vocab, 1, temps[r], top / temps[r]);
    }
    return 0;
}

/* The sampler's greedy picks: each row's largest value's index, the first where several tie, and
 * a NaN anywhere wins (its first index): what torch.max(x, dim=-1).indices gives on the CPU. One
 * vectorised pass for the maximum (NaN found by its bits: -ffast-math assumes there is none),
 * then a scan for where it first occurs. */
static inline int is_nan_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x7fffffffu) > 0x7f800000u;
}

int argmax_rows_f32(const float *x, int64_t *out, int64_t num_rows, int64_t vocab, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows >= 2)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *row = x + r * vocab;
        float best = row[0];
        uint32_t nan = 0;
        for (int64_t v = 0; v < vocab; v++) {
            uint32_t u;
            memcpy(&u, &row[v], sizeof u);
            nan |= (u & 0x7fffffffu) > 0x7f800000u;
            best = row[v] > best ? row[v] : best;
        }
        int64_t at = 0;
        if (nan)
            while (!is_nan_bits(row[at])) at++;
        else
            while (row[at] != best) at++;
        out[r] = at;
    }
    return 0;
}

/* Softmax of a prompt block's attention scores in place, with the causal (and sliding-window) mask
 * applied by bounds instead of a -inf fill: scores [mats][rows][group][cols] in bf16 (one matrix
 * per KV head, its query heads interleaved per row, as matmul_prompt_attention lays them out);
 * row r of every head sees columns [max(0, first + r - window), min(cols, first + r)) (window 0:
 * from 0) and gets zeros elsewhere. Each row as softmax(masked bf16 scores) in float32, rounded to
 * bf16: what `scores.masked_fill_(hidden, -inf).softmax(-1)` gives, in one pass per row and with
 * no mask tensors. The scores are scaled first, rounded to bf16 as transformers' eager attention
 * rounds `(q @ k^T) * scaling` (with a power-of-two scale, as head_dim 64 or 256 give, the multiply
 * is exact), so the caller's queries need no scaled copy. */
int causal_softmax_bf16(uint16_t *scores, int64_t mats, int64_t rows, int64_t group, int64_t cols, int64_t first,
                        int64_t window, float scale, int num_threads) {
    const int64_t num_rows = mats * rows * group;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_rows * cols >= 16384) reduction(| : failed)
    {
        float *e = malloc(sizeof(float) * (cols > 0 ? cols : 1));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_rows; i++) {
            if (e == NULL) {
                failed = 1;
                continue;
            }
            const int64_t r = (i / group) % rows;
            int64_t hi = first + r, lo = window > 0 ? first + r - window : 0;
            hi = hi < cols ? hi : cols;
            lo = lo > 0 ? lo : 0;
            uint16_t *s = scores + i * cols;
            float m = -INFINITY, sum = 0.0f;
            for (int64_t c = lo; c < hi; c++) {
                const float x = round_bf16(bf16_to_f32(s[c]) * scale);
                m = x > m ? x : m;
            }
            for (int64_t c = lo; c < hi; c++) {
                e[c] = expf(round_bf16(bf16_to_f32(s[c]) * scale) - m);
                sum += e[c];
            }
            const float inv = 1.0f / sum;
            for (int64_t c = 0; c < lo; c++) s[c] = 0;
            for (int64_t c = lo; c < hi; c++) s[c] = f32_to_bf16(e[c] * inv);
            for (int64_t c = hi; c < cols; c++) s[c] = 0;
        }
        free(e);
    }
    return failed;
}

/* One step's KV cache write, what two index_copy_ calls do, as row copies: token i's k and v rows
 * (`row` bf16 values each, KVH x D; rows `k_stride` and `v_stride` values apart, as the views into
 * the QKV projection's output leave them) go to row slots[i] of k_cache and v_cache ([num_slots]
 * [row], contiguous). A negative slot skips its token (a padding row). Returns the number of slots
 * at or past num_slots, which are not written (the caller raises). */
int64_t write_kv_bf16(const uint16_t *k, const uint16_t *v, int64_t k_stride, int64_t v_stride, uint16_t *k_cache,
                      uint16_t *v_cache, const int64_t *slots, int64_t num_tokens, int64_t row, int64_t num_slots,
                      int num_threads) {
    int64_t bad = 0;
    const size_t bytes = sizeof(uint16_t) * (size_t)row;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens >= 256) reduction(+ : bad)
    for (int64_t i = 0; i < num_tokens; i++) {
        const int64_t slot = slots[i];
        if (slot < 0) {
            continue;
        }
        if (slot >= num_slots) {
            bad++;
            continue;
        }
        memcpy(k_cache + slot * row, k + i * k_stride, bytes);
        memcpy(v_cache + slot * row, v + i * v_stride, bytes);
    }
    return bad;
}
