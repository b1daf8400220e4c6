/* Paged decode attention on the CPU: one query token per sequence, keys and values read straight
 * from the block-table-addressed cache (no gather copy, no padding to the longest context).
 *
 * Work item = (sequence, KV head): its G query heads (GQA) are scored against every cached key of
 * the sequence, softmaxed in float32, and the values summed; items run in parallel (OpenMP). Each
 * cache block is converted to a float32 tile once and used by all G heads, so the cache is read
 * once per step: what decode attention costs at best on a memory-bound CPU.
 *
 * Layouts (row-major, contiguous):
 *   q, out        [S, KVH * G, D]
 *   k/v cache     [num_blocks, block_size, KVH, D]
 *   block_tables  [S, max_blocks] int64;  ctx_lens [S] int64
 * window > 0 keeps the last `window` keys only (sliding-window attention).
 *
 * Built with -O3 -march=native -ffast-math: the fixed-size inner loops (head_dim 64 and 128 are
 * specialised) become SIMD code and expf maps to glibc's vector variant. Every input is finite
 * (the cache is zeroed, never left uninitialised), which -ffast-math assumes.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_BLOCK_SIZE 256

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

typedef struct {
    int64_t num_kv_heads, group, head_dim, block_size, max_blocks, token_stride, block_stride;
    float scale;
    int64_t window;
} Shape;

/* Rows [0, count) of one cache block for KV head h, as float32 [count][D]. */
static inline void load_tile_bf16(const uint16_t *block, int64_t h, int64_t count, const Shape *sh,
                                  const int64_t D, float *tile) {
    for (int64_t t = 0; t < count; t++) {
        const uint16_t *src = block + t * sh->token_stride + h * D;
        float *dst = tile + t * D;
        for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(src[d]);
    }
}

static inline void load_tile_f32(const float *block, int64_t h, int64_t count, const Shape *sh,
                                 const int64_t D, float *tile) {
    for (int64_t t = 0; t < count; t++) memcpy(tile + t * D, block + t * sh->token_stride + h * D, sizeof(float) * D);
}

/* One (sequence, KV head) item. D is a compile-time constant in the specialised callers. */
#define DEFINE_ITEM(NAME, T, LOAD_TILE)                                                           \
    static inline __attribute__((always_inline)) void NAME(                                      \
        const T *k_cache, const T *v_cache, const int64_t *table, int64_t len, int64_t h,        \
        const Shape *sh, const int64_t D, const float *qf, float *scores, float *tile,            \
        float *acc) {                                                                             \
        const int64_t G = sh->group, bs = sh->block_size;                                         \
        const int64_t first = (sh->window > 0 && len > sh->window) ? len - sh->window : 0;        \
        const int64_t n = len - first;                                                            \
        for (int64_t t0 = first - first % bs; t0 < len; t0 += bs) { /* scores */                  \
            const int64_t lo = t0 < first ? first - t0 : 0, hi = len - t0 < bs ? len - t0 : bs;    \
            LOAD_TILE(k_cache + table[t0 / bs] * sh->block_stride, h, hi, sh, D, tile);           \
            for (int64_t g = 0; g < G; g++) {                                                     \
                const float *qg = qf + g * D;                                                     \
                float *sg = scores + g * n + (t0 - first);                                        \
                for (int64_t t = lo; t < hi; t++) {                                               \
                    const float *k = tile + t * D;                                                \
                    float dot = 0.0f;                                                             \
                    for (int64_t d = 0; d < D; d++) dot += qg[d] * k[d];                          \
                    sg[t] = dot;                                                                  \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t g = 0; g < G; g++) { /* softmax */                                           \
            float *sg = scores + g * n;                                                           \
            float m = -FLT_MAX, sum = 0.0f;                                                       \
            for (int64_t i = 0; i < n; i++) m = sg[i] > m ? sg[i] : m;                            \
            for (int64_t i = 0; i < n; i++) {                                                     \
                sg[i] = expf(sg[i] - m);                                                          \
                sum += sg[i];                                                                     \
            }                                                                                     \
            const float inv = 1.0f / sum;                                                         \
            for (int64_t i = 0; i < n; i++) sg[i] *= inv;                                         \
        }                                                                                         \
        memset(acc, 0, sizeof(float) * G * D);                                                    \
        for (int64_t t0 = first - first % bs; t0 < len; t0 += bs) { /* values */                  \
            const int64_t lo = t0 < first ? first - t0 : 0, hi = len - t0 < bs ? len - t0 : bs;    \
            LOAD_TILE(v_cache + table[t0 / bs] * sh->block_stride, h, hi, sh, D, tile);           \
            for (int64_t g = 0; g < G; g++) {                                                     \
                const float *pg = scores + g * n + (t0 - first);                                  \
                float a[D];                                                                       \
                memcpy(a, acc + g * D, sizeof a);                                                 \
                for (int64_t t = lo; t < hi; t++) {                                               \
                    const float p = pg[t];                                                        \
                    const float *v = tile + t * D;                                                \
                    for (int64_t d = 0; d < D; d++) a[d] += p * v[d];                             \
                }                                                                                 \
                memcpy(acc + g * D, a, sizeof a);                                                 \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_ITEM(item_bf16, uint16_t, load_tile_bf16)
DEFINE_ITEM(item_f32, float, load_tile_f32)

#define DEFINE_PAGED_DECODE(NAME, T, ITEM, TO_F32, FROM_F32)                                      \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *block_tables,         \
             const int64_t *ctx_lens, T *out, int64_t num_seqs, int64_t max_blocks,               \
             int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_dim,            \
             float scale, int64_t window, int num_threads) {                                       \
        if (block_size > MAX_BLOCK_SIZE) return 2;                                                 \
        const Shape sh = {num_kv_heads, group, head_dim, block_size, max_blocks,                   \
                          num_kv_heads * head_dim, block_size * num_kv_heads * head_dim, scale,   \
                          window};                                                                 \
        const int64_t num_items = num_seqs * num_kv_heads;                                         \
        int failed = 0;                                                                            \
        _Pragma("omp parallel num_threads(num_threads) reduction(|:failed)")                      \
        {                                                                                          \
            float *scores = malloc(sizeof(float) * group * max_blocks * block_size);               \
            float *qf = malloc(sizeof(float) * group * head_dim);                                  \
            float *acc = malloc(sizeof(float) * group * head_dim);                                 \
            float *tile = malloc(sizeof(float) * block_size * head_dim);                           \
            const int ok = scores != NULL && qf != NULL && acc != NULL && tile != NULL;            \
            /* every thread reaches the worksharing loop, even one whose buffers failed */         \
            _Pragma("omp for schedule(dynamic, 1)")                                                \
            for (int64_t item = 0; item < num_items; item++) {                                     \
                if (!ok) {                                                                         \
                    failed = 1;                                                                    \
                    continue;                                                                      \
                }                                                                                  \
                const int64_t s = item / num_kv_heads, h = item % num_kv_heads;                    \
                const T *qs = q + (s * num_kv_heads + h) * group * head_dim;                       \
                for (int64_t i = 0; i < group * head_dim; i++) qf[i] = TO_F32(qs[i]) * scale;      \
                const int64_t *table = block_tables + s * max_blocks;                              \
                if (head_dim == 64)                                                                \
                    ITEM(k_cache, v_cache, table, ctx_lens[s], h, &sh, 64, qf, scores, tile, acc); \
                else if (head_dim == 128)                                                          \
                    ITEM(k_cache, v_cache, table, ctx_lens[s], h, &sh, 128, qf, scores, tile, acc);\
                else                                                                               \
                    ITEM(k_cache, v_cache, table, ctx_lens[s], h, &sh, head_dim, qf, scores, tile, \
                         acc);                                                                     \
                T *os = out + (s * num_kv_heads + h) * group * head_dim;                           \
                for (int64_t i = 0; i < group * head_dim; i++) os[i] = FROM_F32(acc[i]);           \
            }                                                                                      \
            free(scores);                                                                          \
            free(qf);                                                                              \
            free(acc);                                                                             \
            free(tile);                                                                            \
        }                                                                                          \
        return failed;                                                                             \
    }

static inline float f32_identity(float x) { return x; }

DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, item_bf16, bf16_to_f32, f32_to_bf16)
DEFINE_PAGED_DECODE(paged_decode_f32, float, item_f32, f32_identity, f32_identity)
