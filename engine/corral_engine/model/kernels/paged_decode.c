/* Paged decode attention on the CPU: one query token per sequence, keys and values read straight
 * from the block-table-addressed cache (no gather copy, no padding to the longest context).
 *
 * Work item = a sequence's KV heads (all of them, or one each when there are few sequences): the
 * G query heads (GQA) of each are scored against every cached key of the sequence, softmaxed in
 * float32, and the values summed; items run in parallel (OpenMP). Each cache block is read where it
 * lies, once per step for keys and once for values: what decode attention costs at best on a
 * memory-bound CPU.
 *
 * Two ways to do the arithmetic:
 * - float32 loops (every CPU, every cache dtype): cache values are converted in registers as they
 *   are read, each key row once for the G query heads that share it.
 * - AMX tiles (bf16 queries over a bf16 cache, built where the compiler targets AMX and the kernel
 *   finds Linux grants tile state; block_size % 16 == 0, head_dim % 64 == 0, G <= 16): keys are
 *   scored 16 at a time, a tile of cache rows times a tile of the G queries, products summed in
 *   float32. Values are summed the same way with the probabilities split into a bf16 high and low
 *   part (about 16 bits kept, not bf16's 8). On a Sapphire Rapids core this is ~1.5x faster than
 *   the float32 loops at batch 128 (docs/engine-speed.md), the difference from them within a
 *   bf16 rounding of the output.
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
 * which -ffast-math assumes, and which lets a 16-key AMX tile read the unused rows of a block
 * (their probabilities are zero).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"

#define MAX_BLOCK_SIZE 256

typedef struct {
    int64_t num_kv_heads, group, head_dim, block_size, max_blocks, token_stride, block_stride;
    float scale;
    int64_t window;
} Shape;

/* One thread's scratch: scores [nh * G][max_blocks * block_size]; qf and acc [nh * G][D]; for AMX,
 * the packed queries (nh * D * 32 bf16), four probability tiles (4 x 512 bf16) and four float32
 * result tiles (4 x 256). */
typedef struct {
    float *scores, *qf, *acc, *cbuf;
    uint16_t *qb, *pbuf;
} Scratch;

static inline float f32_identity(float x) { return x; }

/* fp8 bytes to float32, exactly: normal codes rebuild the float's bits (exponent rebiased),
 * subnormal ones (exponent field 0) are mantissa x 2^(1 - bias - mantissa bits). Branch-free, so
 * the loops vectorise. inf and NaN codes are never written (the engine saturates). */
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

/* Ask for the next block's rows of heads [h0, h0 + nh) while this one is computed: blocks sit at
 * unpredictable addresses, so the hardware prefetcher only ramps up inside each one. */
static inline void prefetch_rows(const char *block, int64_t first_byte, int64_t bytes, int64_t count,
                                 int64_t row_stride) {
    for (int64_t t = 0; t < count; t++)
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(block + t * row_stride + first_byte + b, 0, 3);
}

static void softmax_rows(float *scores, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        float *sr = scores + r * n;
        float m = -FLT_MAX, sum = 0.0f;
        for (int64_t i = 0; i < n; i++) m = sr[i] > m ? sr[i] : m;
        for (int64_t i = 0; i < n; i++) {
            sr[i] = expf(sr[i] - m);
            sum += sr[i];
        }
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < n; i++) sr[i] *= inv;
    }
}

#ifdef HAVE_AMX
/* Queries of KV heads [0, nh) (G each, bf16 [nh * G][D]) as B tiles: per head and 32-dim chunk,
 * 16 rows (dim pairs) x 16 columns (query heads) x 2 dims. Columns >= G stay zero: the caller
 * zeroes qb once per call. */
static void amx_pack_queries(const uint16_t *q, int64_t nh, int64_t G, int64_t D, uint16_t *qb) {
    for (int64_t h = 0; h < nh; h++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d++)
                qb[(h * (D / 32) + d / 32) * 512 + (d % 32 / 2) * 32 + g * 2 + d % 2] = q[(h * G + g) * D + d];
}

/* scores[h * G + g][t] = scale * q[h, g] . k[t, h]: a tile of 16 cached keys' rows (32 dims,
 * read in place, row stride the cache's) times the packed queries, per 32-dim chunk. */
static void amx_scores(const uint16_t *k_cache, const int64_t *table, int64_t len, int64_t first, int64_t h0,
                       int64_t nh, const Shape *sh, int64_t D, Scratch *w) {
    const int64_t G = sh->group, bs = sh->block_size, n = len - first, ts = sh->token_stride;
    for (int64_t t0 = first - first % bs; t0 < len; t0 += bs) {
        if (t0 + bs < len)
            prefetch_rows((const char *)(k_cache + table[(t0 + bs) / bs] * sh->block_stride), h0 * D * 2, nh * D * 2,
                          bs, ts * 2);
        const uint16_t *blk = k_cache + table[t0 / bs] * sh->block_stride + h0 * D;
        for (int64_t s0 = t0; s0 < t0 + bs && s0 < len; s0 += 16) {
            const int64_t lo = s0 < first ? first - s0 : 0, hi = len - s0 < 16 ? len - s0 : 16;
            if (lo >= hi) continue;
            for (int64_t h = 0; h < nh; h++) {
                _tile_zero(0);
                for (int64_t c = 0; c < D / 32; c++) {
                    _tile_loadd(1, blk + (s0 - t0) * ts + h * D + c * 32, ts * 2);
                    _tile_loadd(2, w->qb + (h * (D / 32) + c) * 512, 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, w->cbuf, 64);
                for (int64_t g = 0; g < G; g++) {
                    float *sr = w->scores + (h * G + g) * n + (s0 - first);
                    for (int64_t t = lo; t < hi; t++) sr[t] = w->cbuf[t * 16 + g] * sh->scale;
                }
            }
        }
    }
}

/* acc[h * G + g][d] = sum_t p[h * G + g][t] v[t, h][d]. A V tile is 16 cached rows of 32 dims,
 * read in place; AMX sums products of adjacent column pairs, so each V tile meets two probability
 * tiles: p in the even slots (zeros in the odd) gives the even dims, the other way the odd ones.
 * Each is used as a bf16 high part and a low part (p - high). 64 dims at a time: four
 * accumulators (even/odd x two 32-dim halves) stay in tiles 0-3 over the whole sequence. */
static void amx_values(const uint16_t *v_cache, const int64_t *table, int64_t len, int64_t first, int64_t h0,
                       int64_t nh, const Shape *sh, int64_t D, Scratch *w) {
    const int64_t G = sh->group, bs = sh->block_size, n = len - first, ts = sh->token_stride;
    uint16_t *even_hi = w->pbuf, *even_lo = w->pbuf + 512, *odd_hi = w->pbuf + 1024, *odd_lo = w->pbuf + 1536;
    for (int64_t h = 0; h < nh; h++)
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t t0 = first - first % bs; t0 < len; t0 += bs) {
                if (t0 + bs < len)
                    prefetch_rows((const char *)(v_cache + table[(t0 + bs) / bs] * sh->block_stride),
                                  ((h0 + h) * D + d0) * 2, 128, bs, ts * 2);
                const uint16_t *blk = v_cache + table[t0 / bs] * sh->block_stride + (h0 + h) * D + d0;
                for (int64_t s0 = t0; s0 < t0 + bs && s0 < len; s0 += 16) {
                    const int64_t lo = s0 < first ? first - s0 : 0, hi = len - s0 < 16 ? len - s0 : 16;
                    if (lo >= hi) continue;
                    const __mmask16 live = (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
                    for (int64_t g = 0; g < G; g++) { /* rows >= G stay zero (pbuf zeroed per call) */
                        const __m512 p = _mm512_maskz_loadu_ps(live, w->scores + (h * G + g) * n + (s0 - first));
                        const __m512i ph = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p));
                        const __m512 rest = _mm512_sub_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(ph, 16)));
                        const __m512i pl = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(rest));
                        _mm512_storeu_si512(even_hi + g * 32, ph);
                        _mm512_storeu_si512(even_lo + g * 32, pl);
                        _mm512_storeu_si512(odd_hi + g * 32, _mm512_slli_epi32(ph, 16));
                        _mm512_storeu_si512(odd_lo + g * 32, _mm512_slli_epi32(pl, 16));
                    }
                    const uint16_t *rows = blk + (s0 - t0) * ts;
                    _tile_loadd(4, rows, ts * 2);
                    _tile_loadd(5, rows + 32, ts * 2);
                    _tile_loadd(6, even_hi, 64);
                    _tile_loadd(7, even_lo, 64);
                    _tile_dpbf16ps(0, 6, 4);
                    _tile_dpbf16ps(0, 7, 4);
                    _tile_dpbf16ps(2, 6, 5);
                    _tile_dpbf16ps(2, 7, 5);
                    _tile_loadd(6, odd_hi, 64);
                    _tile_loadd(7, odd_lo, 64);
                    _tile_dpbf16ps(1, 6, 4);
                    _tile_dpbf16ps(1, 7, 4);
                    _tile_dpbf16ps(3, 6, 5);
                    _tile_dpbf16ps(3, 7, 5);
                }
            }
            _tile_stored(0, w->cbuf, 64);
            _tile_stored(1, w->cbuf + 256, 64);
            _tile_stored(2, w->cbuf + 512, 64);
            _tile_stored(3, w->cbuf + 768, 64);
            for (int64_t g = 0; g < G; g++) {
                float *ar = w->acc + (h * G + g) * D + d0;
                for (int64_t c = 0; c < 2; c++)
                    for (int64_t j = 0; j < 2; j++)
                        for (int64_t i = 0; i < 16; i++) ar[c * 32 + 2 * i + j] = w->cbuf[(c * 2 + j) * 256 + g * 16 + i];
            }
        }
}
#else /* no AMX in this build: the float32 loops only */
static void amx_pack_queries(const uint16_t *q, int64_t nh, int64_t G, int64_t D, uint16_t *qb) {
    (void)q, (void)nh, (void)G, (void)D, (void)qb;
}
static void amx_scores(const uint16_t *k_cache, const int64_t *table, int64_t len, int64_t first, int64_t h0,
                       int64_t nh, const Shape *sh, int64_t D, Scratch *w) {
    (void)k_cache, (void)table, (void)len, (void)first, (void)h0, (void)nh, (void)sh, (void)D, (void)w;
}
static void amx_values(const uint16_t *v_cache, const int64_t *table, int64_t len, int64_t first, int64_t h0,
                       int64_t nh, const Shape *sh, int64_t D, Scratch *w) {
    (void)v_cache, (void)table, (void)len, (void)first, (void)h0, (void)nh, (void)sh, (void)D, (void)w;
}
#endif

/* 1 if the bf16 kernel scores with AMX tiles on this CPU for these shapes (tests and the startup log
 * ask). */
int paged_decode_amx(int64_t block_size, int64_t group, int64_t head_dim) {
    return block_size % 16 == 0 && head_dim % 64 == 0 && group <= 16 && amx_usable();
}

/* One item: a sequence's KV heads [h0, h0 + nh), all G query heads of each. Reading several heads
 * per block keeps the cache reads contiguous. D is a compile-time constant in the specialised
 * callers. With amx the tiles do the scores and values (bf16 only); otherwise float32 loops, each
 * cache value converted once per query head. */
#define DEFINE_ITEM(NAME, T, TO_F32)                                                                                   \
    static inline __attribute__((always_inline)) void NAME(const T *k_cache, const T *v_cache, const int64_t *table, \
                                                           int64_t len, int64_t h0, int64_t nh, const Shape *sh,     \
                                                           const int64_t D, int amx, Scratch *w) {                   \
        const int64_t G = sh->group, bs = sh->block_size, rows = nh * G, ts = sh->token_stride;                       \
        const int64_t first = (sh->window > 0 && len > sh->window) ? len - sh->window : 0;                            \
        const int64_t n = len - first;                                                                                \
        if (amx)                                                                                                      \
            amx_scores((const uint16_t *)k_cache, table, len, first, h0, nh, sh, D, w);                               \
        else                                                                                                          \
            for (int64_t t0 = first - first % bs; t0 < len; t0 += bs) {                                               \
                const int64_t lo = t0 < first ? first - t0 : 0, hi = len - t0 < bs ? len - t0 : bs;                   \
                if (t0 + bs < len)                                                                                    \
                    prefetch_rows((const char *)(k_cache + table[(t0 + bs) / bs] * sh->block_stride),                 \
                                  h0 * D * (int64_t)sizeof(T), nh * D * (int64_t)sizeof(T), bs,                       \
                                  ts * (int64_t)sizeof(T));                                                           \
                const T *blk = k_cache + table[t0 / bs] * sh->block_stride + h0 * D;                                  \
                for (int64_t r = 0; r < rows; r++) {                                                                  \
                    const float *qr = w->qf + r * D;                                                                  \
                    const T *kh = blk + (r / G) * D;                                                                  \
                    float *sr = w->scores + r * n + (t0 - first);                                                     \
                    for (int64_t t = lo; t < hi; t++) {                                                               \
                        const T *k = kh + t * ts;                                                                     \
                        float dot = 0.0f;                                                                             \
                        for (int64_t d = 0; d < D; d++) dot += qr[d] * TO_F32(k[d]);                                  \
                        sr[t] = dot;                                                                                  \
                    }                                                                                                 \
                }                                                                                                     \
            }                                                                                                         \
        softmax_rows(w->scores, rows, n);                                                                             \
        if (amx) {                                                                                                    \
            amx_values((const uint16_t *)v_cache, table, len, first, h0, nh, sh, D, w);                               \
            return;                                                                                                   \
        }                                                                                                             \
        memset(w->acc, 0, sizeof(float) * rows * D);                                                                  \
        for (int64_t t0 = first - first % bs; t0 < len; t0 += bs) {                                                   \
            const int64_t lo = t0 < first ? first - t0 : 0, hi = len - t0 < bs ? len - t0 : bs;                       \
            if (t0 + bs < len)                                                                                        \
                prefetch_rows((const char *)(v_cache + table[(t0 + bs) / bs] * sh->block_stride),                     \
                              h0 * D * (int64_t)sizeof(T), nh * D * (int64_t)sizeof(T), bs, ts * (int64_t)sizeof(T)); \
            const T *blk = v_cache + table[t0 / bs] * sh->block_stride + h0 * D;                                      \
            for (int64_t r = 0; r < rows; r++) {                                                                      \
                const float *pr = w->scores + r * n + (t0 - first);                                                   \
                const T *vh = blk + (r / G) * D;                                                                      \
                float a[D];                                                                                           \
                memcpy(a, w->acc + r * D, sizeof a);                                                                  \
                for (int64_t t = lo; t < hi; t++) {                                                                   \
                    const float p = pr[t];                                                                            \
                    const T *v = vh + t * ts;                                                                         \
                    for (int64_t d = 0; d < D; d++) a[d] += p * TO_F32(v[d]);                                         \
                }                                                                                                     \
                memcpy(w->acc + r * D, a, sizeof a);                                                                  \
            }                                                                                                         \
        }                                                                                                             \
    }

DEFINE_ITEM(item_bf16, uint16_t, bf16_to_f32)
DEFINE_ITEM(item_f32, float, f32_identity)
DEFINE_ITEM(item_e4m3, uint8_t, e4m3_to_f32)
DEFINE_ITEM(item_e5m2, uint8_t, e5m2_to_f32)

/* T: the queries' and output's element type; C: the cache's. AMX: 1 where T and C are bf16. */
#define DEFINE_PAGED_DECODE(NAME, T, C, ITEM, TO_F32, FROM_F32, AMX)                                                   \
    int NAME(const T *q, const C *k_cache, const C *v_cache, const int64_t *block_tables, const int64_t *ctx_lens,    \
             T *out, int64_t num_seqs, int64_t max_blocks, int64_t block_size, int64_t num_kv_heads, int64_t group,    \
             int64_t head_dim, float scale, int64_t window, int num_threads) {                                        \
        if (block_size > MAX_BLOCK_SIZE) return 2;                                                                     \
        const Shape sh = {num_kv_heads, group, head_dim, block_size, max_blocks,                                       \
                          num_kv_heads * head_dim, block_size * num_kv_heads * head_dim, scale,                       \
                          window};                                                                                     \
        /* Whole sequences per item when there are enough of them to keep every thread busy;                         \
         * otherwise one KV head per item, so a few long sequences still use all threads. */                         \
        const int64_t nh = num_seqs >= 4 * (int64_t)num_threads ? num_kv_heads : 1;                                   \
        const int64_t items_per_seq = num_kv_heads / nh, num_items = num_seqs * items_per_seq;                        \
        const int64_t rows = nh * group;                                                                               \
        const int amx = AMX && paged_decode_amx(block_size, group, head_dim);                                          \
        int failed = 0;                                                                                                \
        _Pragma("omp parallel num_threads(num_threads) reduction(|:failed)") {                                         \
            Scratch w = {malloc(sizeof(float) * rows * max_blocks * block_size), malloc(sizeof(float) * rows * head_dim), \
                         malloc(sizeof(float) * rows * head_dim), NULL, NULL, NULL};                                   \
            if (amx) {                                                                                                 \
                w.cbuf = malloc(sizeof(float) * 4 * 256);                                                              \
                w.qb = calloc((size_t)(nh * head_dim * 32), sizeof(uint16_t));                                         \
                w.pbuf = calloc(4 * 512, sizeof(uint16_t));                                                            \
            }                                                                                                          \
            const int ok = w.scores != NULL && w.qf != NULL && w.acc != NULL &&                                       \
                           (!amx || (w.cbuf != NULL && w.qb != NULL && w.pbuf != NULL));                               \
            if (amx && ok) amx_begin();                                                                                \
            /* every thread reaches the worksharing loop, even one whose buffers failed */                             \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < num_items; item++) {                 \
                if (!ok) {                                                                                             \
                    failed = 1;                                                                                        \
                    continue;                                                                                          \
                }                                                                                                      \
                const int64_t s = item / items_per_seq, h0 = (item % items_per_seq) * nh;                              \
                const T *qs = q + (s * num_kv_heads + h0) * group * head_dim;                                          \
                if (amx)                                                                                               \
                    amx_pack_queries((const uint16_t *)qs, nh, group, head_dim, w.qb);                                 \
                else                                                                                                   \
                    for (int64_t i = 0; i < rows * head_dim; i++) w.qf[i] = TO_F32(qs[i]) * scale;                     \
                const int64_t *table = block_tables + s * max_blocks;                                                  \
                if (head_dim == 64)                                                                                    \
                    ITEM(k_cache, v_cache, table, ctx_lens[s], h0, nh, &sh, 64, amx, &w);                              \
                else if (head_dim == 128)                                                                              \
                    ITEM(k_cache, v_cache, table, ctx_lens[s], h0, nh, &sh, 128, amx, &w);                             \
                else                                                                                                   \
                    ITEM(k_cache, v_cache, table, ctx_lens[s], h0, nh, &sh, head_dim, amx, &w);                        \
                T *os = out + (s * num_kv_heads + h0) * group * head_dim;                                              \
                for (int64_t i = 0; i < rows * head_dim; i++) os[i] = FROM_F32(w.acc[i]);                              \
            }                                                                                                          \
            if (amx && ok) amx_end();                                                                                  \
            free(w.scores);                                                                                            \
            free(w.qf);                                                                                                \
            free(w.acc);                                                                                               \
            free(w.cbuf);                                                                                              \
            free(w.qb);                                                                                                \
            free(w.pbuf);                                                                                              \
        }                                                                                                              \
        return failed;                                                                                                 \
    }

DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, uint16_t, item_bf16, bf16_to_f32, f32_to_bf16, 1)
DEFINE_PAGED_DECODE(paged_decode_f32, float, float, item_f32, f32_identity, f32_identity, 0)
/* fp8 caches (--kv-cache-dtype): the queries' dtype, then the cache's */
DEFINE_PAGED_DECODE(paged_decode_bf16_e4m3, uint16_t, uint8_t, item_e4m3, bf16_to_f32, f32_to_bf16, 0)
DEFINE_PAGED_DECODE(paged_decode_bf16_e5m2, uint16_t, uint8_t, item_e5m2, bf16_to_f32, f32_to_bf16, 0)
DEFINE_PAGED_DECODE(paged_decode_f32_e4m3, float, uint8_t, item_e4m3, f32_identity, f32_identity, 0)
DEFINE_PAGED_DECODE(paged_decode_f32_e5m2, float, uint8_t, item_e5m2, f32_identity, f32_identity, 0)
