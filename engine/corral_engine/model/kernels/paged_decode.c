/* Paged decode attention on the CPU: one query token per sequence, keys and values read straight
 * from the block-table-addressed cache (no gather copy, no padding to the longest context).
 *
 * Work item = a sequence's KV heads (all of them, or one each when there are few sequences): the
 * G query heads (GQA) of each are scored against every cached key of the sequence, softmaxed in
 * float32, and the values summed; items run in parallel (OpenMP). Each cache block is read
 * contiguously and converted to a float32 tile once for all its query heads, so the cache is read
 * once per step: what decode attention costs at best on a memory-bound CPU.
 *
 * Layouts (row-major, contiguous):
 *   q, out        [S, KVH * G, D]
 *   k/v cache     [num_blocks, block_size, KVH, D]: the queries' dtype, or fp8 (e4m3fn, e5m2 bytes)
 *   block_tables  [S, max_blocks] int64;  ctx_lens [S] int64
 * window > 0 keeps the last `window` keys only (sliding-window attention).
 *
 * Built with -O3 -march=native -ffast-math: the fixed-size inner loops (head_dim 64 and 128 are
 * specialised) become SIMD code and expf maps to glibc's vector variant. Every input is finite
 * (the cache is zeroed, never left uninitialised, and fp8 writes saturate: no inf or NaN codes),
 * which -ffast-math assumes.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_BLOCK_SIZE 256

typedef struct {
    int64_t num_kv_heads, group, head_dim, block_size, max_blocks, token_stride, block_stride;
    float scale;
    int64_t window;
} Shape;

/* Rows [0, count) of one cache block, KV heads [h0, h0 + nh), as float32 [count][nh * D]. */
static inline void load_tile_bf16(const uint16_t *block, int64_t h0, int64_t nh, int64_t count,
                                  const Shape *sh, const int64_t D, float *tile) {
    const int64_t width = nh * D;
    for (int64_t t = 0; t < count; t++) {
        const uint16_t *src = block + t * sh->token_stride + h0 * D;
        float *dst = tile + t * width;
        for (int64_t i = 0; i < width; i++) dst[i] = bf16_to_f32(src[i]);
    }
}

/* fp8 bytes to float32, exactly: normal codes rebuild the float's bits (exponent rebiased),
 * subnormal ones (exponent field 0) are mantissa x 2^(1 - bias - mantissa bits). Branch-free, so
 * the tile loops vectorise. inf and NaN codes are never written (the engine saturates). */
static inline float fp8_to_f32(uint8_t x, const int mant_bits, const int bias) {
    const uint32_t sign = (uint32_t)(x & 0x80u) << 24, em = x & 0x7Fu;
    const uint32_t bits = sign | ((em << (23 - mant_bits)) + ((uint32_t)(127 - bias) << 23));
    float normal;
    memcpy(&normal, &bits, sizeof normal);
    const float sub = (float)(em) * ldexpf(1.0f, 1 - bias - mant_bits);
    return em >> mant_bits ? normal : (x & 0x80u ? -sub : sub);
}

static inline float e4m3_to_f32(uint8_t x) { return fp8_to_f32(x, 3, 7); }
static inline float e5m2_to_f32(uint8_t x) { return fp8_to_f32(x, 2, 15); }

#define DEFINE_LOAD_TILE_FP8(NAME, TO_F32)                                                          \
    static inline void NAME(const uint8_t *block, int64_t h0, int64_t nh, int64_t count,          \
                            const Shape *sh, const int64_t D, float *tile) {                      \
        const int64_t width = nh * D;                                                             \
        for (int64_t t = 0; t < count; t++) {                                                     \
            const uint8_t *src = block + t * sh->token_stride + h0 * D;                           \
            float *dst = tile + t * width;                                                        \
            for (int64_t i = 0; i < width; i++) dst[i] = TO_F32(src[i]);                         \
        }                                                                                         \
    }

DEFINE_LOAD_TILE_FP8(load_tile_e4m3, e4m3_to_f32)
DEFINE_LOAD_TILE_FP8(load_tile_e5m2, e5m2_to_f32)

static inline void load_tile_f32(const float *block, int64_t h0, int64_t nh, int64_t count,
                                 const Shape *sh, const int64_t D, float *tile) {
    for (int64_t t = 0; t < count; t++)
        memcpy(tile + t * nh * D, block + t * sh->token_stride + h0 * D, sizeof(float) * nh * D);
}

/* Ask for the next block's rows of heads [h0, h0 + nh) while this one is computed: blocks sit at
 * unpredictable addresses, so the hardware prefetcher only ramps up inside each one. */
static inline void prefetch_rows(const char *block, int64_t first_byte, int64_t bytes, int64_t count,
                                 int64_t row_stride) {
    for (int64_t t = 0; t < count; t++)
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(block + t * row_stride + first_byte + b, 0, 3);
}

/* One item: a sequence's KV heads [h0, h0 + nh), all G query heads of each. Reading several heads
 * per block keeps the cache reads contiguous. D is a compile-time constant in the specialised
 * callers. qf and acc are [nh * G][D]; scores [nh * G][n]; tile [block_size][nh * D]. */
#define DEFINE_ITEM(NAME, T, LOAD_TILE)                                                           \
    static inline __attribute__((always_inline)) void NAME(                                      \
        const T *k_cache, const T *v_cache, const int64_t *table, int64_t len, int64_t h0,       \
        int64_t nh, const Shape *sh, const int64_t D, const float *qf, float *scores,            \
        float *tile, float *acc) {                                                                \
        const int64_t G = sh->group, bs = sh->block_size, rows = nh * G, width = nh * D;          \
        const int64_t first = (sh->window > 0 && len > sh->window) ? len - sh->window : 0;        \
        const int64_t n = len - first;                                                            \
        for (int64_t t0 = first - first % bs; t0 < len; t0 += bs) { /* scores */                  \
            const int64_t lo = t0 < first ? first - t0 : 0, hi = len - t0 < bs ? len - t0 : bs;    \
            if (t0 + bs < len)                                                                    \
                prefetch_rows((const char *)(k_cache + table[(t0 + bs) / bs] * sh->block_stride),  \
                              h0 * D * (int64_t)sizeof(T), width * (int64_t)sizeof(T), bs,        \
                              sh->token_stride * (int64_t)sizeof(T));                             \
            LOAD_TILE(k_cache + table[t0 / bs] * sh->block_stride, h0, nh, hi, sh, D, tile);      \
            for (int64_t r = 0; r < rows; r++) {                                                  \
                const float *qr = qf + r * D;                                                     \
                const float *kh = tile + (r / G) * D;                                             \
                float *sr = scores + r * n + (t0 - first);                                        \
                for (int64_t t = lo; t < hi; t++) {                                               \
                    const float *k = kh + t * width;                                              \
                    float dot = 0.0f;                                                             \
                    for (int64_t d = 0; d < D; d++) dot += qr[d] * k[d];                          \
                    sr[t] = dot;                                                                  \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t r = 0; r < rows; r++) { /* softmax */                                        \
            float *sr = scores + r * n;                                                           \
            float m = -FLT_MAX, sum = 0.0f;                                                       \
            for (int64_t i = 0; i < n; i++) m = sr[i] > m ? sr[i] : m;                            \
            for (int64_t i = 0; i < n; i++) {                                                     \
                sr[i] = expf(sr[i] - m);                                                          \
                sum += sr[i];                                                                     \
            }                                                                                     \
            const float inv = 1.0f / sum;                                                         \
            for (int64_t i = 0; i < n; i++) sr[i] *= inv;                                         \
        }                                                                                         \
        memset(acc, 0, sizeof(float) * rows * D);                                                 \
        for (int64_t t0 = first - first % bs; t0 < len; t0 += bs) { /* values */                  \
            const int64_t lo = t0 < first ? first - t0 : 0, hi = len - t0 < bs ? len - t0 : bs;    \
            if (t0 + bs < len)                                                                    \
                prefetch_rows((const char *)(v_cache + table[(t0 + bs) / bs] * sh->block_stride),  \
                              h0 * D * (int64_t)sizeof(T), width * (int64_t)sizeof(T), bs,        \
                              sh->token_stride * (int64_t)sizeof(T));                             \
            LOAD_TILE(v_cache + table[t0 / bs] * sh->block_stride, h0, nh, hi, sh, D, tile);      \
            for (int64_t r = 0; r < rows; r++) {                                                  \
                const float *pr = scores + r * n + (t0 - first);                                  \
                const float *vh = tile + (r / G) * D;                                             \
                float a[D];                                                                       \
                memcpy(a, acc + r * D, sizeof a);                                                 \
                for (int64_t t = lo; t < hi; t++) {                                               \
                    const float p = pr[t];                                                        \
                    const float *v = vh + t * width;                                              \
                    for (int64_t d = 0; d < D; d++) a[d] += p * v[d];                             \
                }                                                                                 \
                memcpy(acc + r * D, a, sizeof a);                                                 \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_ITEM(item_bf16, uint16_t, load_tile_bf16)
DEFINE_ITEM(item_f32, float, load_tile_f32)
DEFINE_ITEM(item_e4m3, uint8_t, load_tile_e4m3)
DEFINE_ITEM(item_e5m2, uint8_t, load_tile_e5m2)

/* T: the queries' and output's element type; C: the cache's. */
#define DEFINE_PAGED_DECODE(NAME, T, C, ITEM, TO_F32, FROM_F32)                                   \
    int NAME(const T *q, const C *k_cache, const C *v_cache, const int64_t *block_tables,         \
             const int64_t *ctx_lens, T *out, int64_t num_seqs, int64_t max_blocks,               \
             int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_dim,            \
             float scale, int64_t window, int num_threads) {                                       \
        if (block_size > MAX_BLOCK_SIZE) return 2;                                                 \
        const Shape sh = {num_kv_heads, group, head_dim, block_size, max_blocks,                   \
                          num_kv_heads * head_dim, block_size * num_kv_heads * head_dim, scale,   \
                          window};                                                                 \
        /* Whole sequences per item when there are enough of them to keep every thread busy;     \
         * otherwise one KV head per item, so a few long sequences still use all threads. */     \
        const int64_t nh = num_seqs >= 4 * (int64_t)num_threads ? num_kv_heads : 1;               \
        const int64_t items_per_seq = num_kv_heads / nh, num_items = num_seqs * items_per_seq;    \
        const int64_t rows = nh * group;                                                           \
        int failed = 0;                                                                            \
        _Pragma("omp parallel num_threads(num_threads) reduction(|:failed)")                      \
        {                                                                                          \
            float *scores = malloc(sizeof(float) * rows * max_blocks * block_size);                \
            float *qf = malloc(sizeof(float) * rows * head_dim);                                   \
            float *acc = malloc(sizeof(float) * rows * head_dim);                                  \
            float *tile = malloc(sizeof(float) * block_size * nh * head_dim);                      \
            const int ok = scores != NULL && qf != NULL && acc != NULL && tile != NULL;            \
            /* every thread reaches the worksharing loop, even one whose buffers failed */         \
            _Pragma("omp for schedule(dynamic, 1)")                                                \
            for (int64_t item = 0; item < num_items; item++) {                                     \
                if (!ok) {                                                                         \
                    failed = 1;                                                                    \
                    continue;                                                                      \
                }                                                                                  \
                const int64_t s = item / items_per_seq, h0 = (item % items_per_seq) * nh;          \
                const T *qs = q + (s * num_kv_heads + h0) * group * head_dim;                      \
                for (int64_t i = 0; i < rows * head_dim; i++) qf[i] = TO_F32(qs[i]) * scale;       \
                const int64_t *table = block_tables + s * max_blocks;                              \
                if (head_dim == 64)                                                                \
                    ITEM(k_cache, v_cache, table, ctx_lens[s], h0, nh, &sh, 64, qf, scores, tile,  \
                         acc);                                                                     \
                else if (head_dim == 128)                                                          \
                    ITEM(k_cache, v_cache, table, ctx_lens[s], h0, nh, &sh, 128, qf, scores, tile, \
                         acc);                                                                     \
                else                                                                               \
                    ITEM(k_cache, v_cache, table, ctx_lens[s], h0, nh, &sh, head_dim, qf, scores,  \
                         tile, acc);                                                               \
                T *os = out + (s * num_kv_heads + h0) * group * head_dim;                          \
                for (int64_t i = 0; i < rows * head_dim; i++) os[i] = FROM_F32(acc[i]);            \
            }                                                                                      \
            free(scores);                                                                          \
            free(qf);                                                                              \
            free(acc);                                                                             \
            free(tile);                                                                            \
        }                                                                                          \
        return failed;                                                                             \
    }

static inline float f32_identity(float x) { return x; }

DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, uint16_t, item_bf16, bf16_to_f32, f32_to_bf16)
DEFINE_PAGED_DECODE(paged_decode_f32, float, float, item_f32, f32_identity, f32_identity)
/* fp8 caches (--kv-cache-dtype): the queries' dtype, then the cache's */
DEFINE_PAGED_DECODE(paged_decode_bf16_e4m3, uint16_t, uint8_t, item_e4m3, bf16_to_f32, f32_to_bf16)
DEFINE_PAGED_DECODE(paged_decode_bf16_e5m2, uint16_t, uint8_t, item_e5m2, bf16_to_f32, f32_to_bf16)
DEFINE_PAGED_DECODE(paged_decode_f32_e4m3, float, uint8_t, item_e4m3, f32_identity, f32_identity)
DEFINE_PAGED_DECODE(paged_decode_f32_e5m2, float, uint8_t, item_e5m2, f32_identity, f32_identity)
